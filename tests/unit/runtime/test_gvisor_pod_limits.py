"""gVisor's limits on the pod's cgroup (runtime/kinds/gvisor.py's PodCgroupLimits): the
sandbox's host cgroup holds the total of its containers' limits, kept as containers are
created and updated, and an update the pod's total cannot carry is refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cri_shim.errors import FailedPrecondition, NotFound
from cri_shim.runtime.container_files import ContainerFiles
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.kinds.base import CONTAINER_TYPE, SANDBOX_ID
from cri_shim.runtime.kinds.gvisor import GVisorKind, PodCgroupLimits

MiB = 1 << 20


def _member(
    files: ContainerFiles, cgroup_root: Path, cid: str, kind: str, memory: int | None
) -> dict[str, Any]:
    """A container of pod `pod` in the handler's files: its meta, bundle and v1 cgroup."""
    bundle = files.state_dir / "bundles" / cid
    bundle.mkdir(parents=True)
    spec: dict[str, Any] = {
        "annotations": {CONTAINER_TYPE: kind, SANDBOX_ID: "pod"},
        "linux": {"cgroupsPath": f"/pods/{cid}"},
    }
    if memory is not None:
        spec["linux"]["resources"] = {"memory": {"limit": memory}}
    (bundle / "config.json").write_text(json.dumps(spec))
    (files.containers / cid).mkdir(parents=True)
    meta = {"bundle": str(bundle), "log_path": "", "cgroups_path": f"/pods/{cid}"}
    (files.containers / cid / "meta.json").write_text(json.dumps(meta))
    (cgroup_root / "memory" / "pods" / cid).mkdir(parents=True)
    return spec


def _memory_limit(cgroup_root: Path, cid: str) -> int:
    return int((cgroup_root / "memory" / "pods" / cid / "memory.limit_in_bytes").read_text())


@pytest.fixture
def pod(tmp_path: Path, host: HostLimits) -> tuple[PodCgroupLimits, ContainerFiles, Path]:
    files = ContainerFiles(tmp_path / "state")
    cgroups = tmp_path / "cgroup"
    handler = SimpleNamespace(
        handler_name="gvisor",
        files=files,
        cgroup_root=cgroups,
        oci=None,  # never asked: runsc has no `update`
        host_limits=lambda: host,
    )
    limits = GVisorKind(Path("runsc")).limits(handler)
    assert isinstance(limits, PodCgroupLimits)
    _member(files, cgroups, "pod", "sandbox", None)
    return limits, files, cgroups


async def test_a_created_container_grows_the_pods_cgroup_by_its_limits(
    pod: tuple[PodCgroupLimits, ContainerFiles, Path],
) -> None:
    limits, files, cgroups = pod
    _member(files, cgroups, "a", "container", 64 * MiB)
    await limits.created(_member(files, cgroups, "b", "container", 32 * MiB))
    assert _memory_limit(cgroups, "pod") == 96 * MiB


async def test_an_update_rewrites_the_pods_total_the_containers_cgroup_and_its_spec(
    pod: tuple[PodCgroupLimits, ContainerFiles, Path],
) -> None:
    limits, files, cgroups = pod
    _member(files, cgroups, "a", "container", 64 * MiB)
    _member(files, cgroups, "b", "container", 32 * MiB)
    await asyncio.gather(
        limits.update("a", {"memory": {"limit": 128 * MiB}}),
        limits.update("b", {"memory": {"limit": 16 * MiB}}),
    )
    # Under the pod's lock, neither update summed the other's old limit.
    assert _memory_limit(cgroups, "pod") == 144 * MiB
    assert _memory_limit(cgroups, "a") == 128 * MiB
    spec = json.loads((files.state_dir / "bundles" / "a" / "config.json").read_text())
    assert spec["linux"]["resources"] == {"memory": {"limit": 128 * MiB}}


async def test_an_update_the_pods_total_cannot_carry_is_refused(
    pod: tuple[PodCgroupLimits, ContainerFiles, Path],
) -> None:
    limits, files, cgroups = pod
    _member(files, cgroups, "a", "container", 64 * MiB)
    with pytest.raises(FailedPrecondition, match=r"'gvisor' \(gVisor\) cannot apply"):
        await limits.update("a", {"unified": {"memory.high": "max"}})
    with pytest.raises(NotFound, match="not known to runtime handler gvisor"):
        await limits.update("gone", {"memory": {"limit": MiB}})


async def test_the_pods_lock_goes_with_its_sandbox(
    pod: tuple[PodCgroupLimits, ContainerFiles, Path],
) -> None:
    limits, files, cgroups = pod
    _member(files, cgroups, "a", "container", 64 * MiB)
    await limits.update("a", {"memory": {"limit": 32 * MiB}})
    assert list(limits._pod_locks) == ["pod"]
    limits.forget("a")
    assert list(limits._pod_locks) == ["pod"]
    limits.forget("pod")
    assert limits._pod_locks == {}
