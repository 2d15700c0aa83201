"""conmon's placement under the systemd driver, through RuntimeBackend over the test
doubles and fakes of systemd's bus: each conmon is moved into its own scope in the
configured slice once it has made its container (by pidfd where systemd takes one), a
failed placement undoes the create (a systemd that never answers too, within the call's
bound), and a delete stops the container's scope where its runtime left it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_shim.errors import Internal, Unavailable
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.conmon_scope import ConmonScopes
from cri_shim.runtime.host_limits import HostLimits
from tests.fake_systemd import SETUP, FakeBusSocket, FakeSystemdBus, manager_on
from tests.unit.runtime.conftest import backend_over_doubles, spec_for

POD_SLICE = "kubepods-besteffort-pod1.slice"


@pytest.fixture
async def systemd_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: HostLimits
) -> AsyncIterator[tuple[RuntimeBackend, FakeSystemdBus]]:
    bus = FakeSystemdBus()
    # Longer bounds, not expectations: the doubles are slow under emulation.
    scopes = ConmonScopes(manager_on(bus), "pod")
    async for backend in backend_over_doubles(tmp_path, monkeypatch, host, 60, scopes=scopes):
        yield backend, bus


async def create_in_slice(backend: RuntimeBackend, tmp_path: Path, cid: str) -> int:
    spec = spec_for(tmp_path, "sleep 30")
    spec["linux"]["cgroupsPath"] = f"{POD_SLICE}:cri-shim:{cid}"
    return await backend.create(
        cid, tmp_path / "bundles" / cid, spec, tmp_path / f"{cid}.log", False, False
    )


@pytest.mark.parametrize(("version", "given_as"), [("252", "PIDs"), ("253", "PIDFDs")])
async def test_conmon_is_placed_in_a_scope_of_the_pods_slice(
    systemd_backend: tuple[RuntimeBackend, FakeSystemdBus],
    tmp_path: Path,
    version: str,
    given_as: str,
) -> None:
    backend, bus = systemd_backend
    bus.version = version
    await create_in_slice(backend, tmp_path, "c1")
    conmon_pid = int((tmp_path / "state" / "containers" / "c1" / "conmon.pid").read_text())
    scope = bus.units["cri-shim-conmon-c1.scope"]
    # The fake reads the process behind each pidfd, as systemd does.
    assert scope["Slice"] == POD_SLICE and scope[given_as] == [conmon_pid]
    assert conmon_pid in processes_of(tmp_path / "bundles" / "c1")


async def test_delete_stops_the_container_scope_the_runtime_left(
    systemd_backend: tuple[RuntimeBackend, FakeSystemdBus], tmp_path: Path
) -> None:
    backend, bus = systemd_backend
    await create_in_slice(backend, tmp_path, "c1")
    bus.units["cri-shim-c1.scope"] = {}  # as runc killed within its create leaves it
    await backend.delete("c1")
    assert "cri-shim-c1.scope" not in bus.units
    assert ["cri-shim-c1.scope", "replace"] in [m.body for m in bus.calls if m.member == "StopUnit"]


async def test_a_failed_placement_undoes_the_create(
    systemd_backend: tuple[RuntimeBackend, FakeSystemdBus], tmp_path: Path
) -> None:
    backend, bus = systemd_backend
    bus.job_result = "failed"
    with pytest.raises(Internal, match=r"could not start cri-shim-conmon-c1\.scope"):
        await create_in_slice(backend, tmp_path, "c1")
    assert list((tmp_path / "state" / "containers").iterdir()) == []


async def test_a_systemd_that_never_answers_fails_the_create_within_its_bound_and_undoes_it(
    tmp_path: Path, short_tmp: Path, monkeypatch: pytest.MonkeyPatch, host: HostLimits
) -> None:
    # A bus that connects and then never answers systemd's calls (a wedged PID 1).
    bus = FakeBusSocket(short_tmp / "bus", SETUP)
    scopes = ConmonScopes(bus.manager(call_timeout=0.5), "pod")
    try:
        async for backend in backend_over_doubles(tmp_path, monkeypatch, host, 60, scopes=scopes):
            with pytest.raises(
                Unavailable,
                match=r"^systemd did not answer StartTransientUnit of cri-shim-conmon-c1\.scope",
            ):
                await asyncio.wait_for(create_in_slice(backend, tmp_path, "c1"), 30)
            # The container the runtime made is gone with its conmon, and no files stay.
            assert list((tmp_path / "state" / "containers").iterdir()) == []
            assert processes_of(tmp_path / "bundles" / "c1") == []
    finally:
        bus.close()


def processes_of(bundle: Path) -> list[int]:
    """The processes whose command line names `bundle` (conmon's, the runtime's)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(bundle).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found
