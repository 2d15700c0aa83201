"""How a container is deleted (runtime/delete.py), over the test doubles: out of the
runtime, its conmon gone, its files and empty cgroups removed.
"""

from __future__ import annotations

from pathlib import Path

from cri_shim.runtime.conmon import RuntimeBackend
from tests.unit.runtime.conftest import alive, create


async def test_delete_removes_the_cgroups_a_runtime_killed_inside_create_left(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    # runc killed within its create (a create past its budget, a stopping daemon) has
    # made the container's cgroups, cpuset first, but not the state its delete reads.
    await create(stub_backend, tmp_path, "true")
    cgroups = tmp_path / "cgroup"
    for hierarchy in ("cpuset", "memory"):
        (cgroups / hierarchy / "cri-shim" / "c1").mkdir(parents=True)
    (cgroups / "memory" / "cri-shim" / "c1" / "busy").mkdir()  # not empty: stays
    await stub_backend.delete("c1")
    assert not (cgroups / "cpuset" / "cri-shim" / "c1").exists()
    assert (cgroups / "memory" / "cri-shim" / "c1").exists()
    assert (cgroups / "cpuset" / "cri-shim").exists()  # the parent is not the container's


async def test_delete_kills_and_removes_everything_and_is_idempotent(
    stub_backend: RuntimeBackend, tmp_path: Path
) -> None:
    pid = await create(stub_backend, tmp_path, "exec sleep 30")
    await stub_backend.start("c1")
    conmon_pid = int((tmp_path / "state" / "containers" / "c1" / "conmon.pid").read_text())
    assert alive(conmon_pid)
    await stub_backend.delete("c1")
    assert not alive(pid)
    assert not alive(conmon_pid)
    assert not (tmp_path / "state" / "containers" / "c1").exists()
    assert not (tmp_path / "state" / "exits" / "c1").exists()
    assert not (tmp_path / "runtime-root" / "c1").exists()
    assert not (tmp_path / "bundles" / "c1" / "ctl").exists()
    await stub_backend.delete("c1")
    assert await stub_backend.state("c1") == "unknown"
