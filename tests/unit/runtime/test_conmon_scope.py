"""conmon's placement under the systemd driver, through RuntimeBackend over the test
doubles and a fake of systemd's bus: each conmon is moved into its own scope in the
configured slice once it has made its container, a failed placement undoes the create,
and a delete stops the container's scope where its runtime left it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_shim.errors import Internal
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.conmon_scope import ConmonScopes
from cri_shim.runtime.host_limits import HostLimits
from tests.fake_systemd import FakeSystemdBus, manager_on
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


async def test_conmon_is_placed_in_a_scope_of_the_pods_slice(
    systemd_backend: tuple[RuntimeBackend, FakeSystemdBus], tmp_path: Path
) -> None:
    backend, bus = systemd_backend
    await create_in_slice(backend, tmp_path, "c1")
    conmon_pid = int((tmp_path / "state" / "containers" / "c1" / "conmon.pid").read_text())
    scope = bus.units["cri-shim-conmon-c1.scope"]
    assert scope["Slice"] == POD_SLICE and scope["PIDs"] == [conmon_pid]


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
