"""What a handler's backend parts share (runtime/handler_runtime.py): the host's cgroup
layout, and a container's removal from the runtime with the cgroups its delete leaves.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cri_shim.errors import FailedPrecondition
from cri_shim.runtime.cgroup_layout import cgroup_layout
from cri_shim.runtime.container_files import ContainerFiles, Meta
from cri_shim.runtime.handler_runtime import HandlerRuntime, executable, remove_cgroups
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.kinds.base import HandlerKind


def test_systemd_cgroups_are_left_to_systemd(tmp_path: Path) -> None:
    (tmp_path / "cpu" / "system.slice" / "cri-shim-c.scope").mkdir(parents=True)
    remove_cgroups("system.slice:cri-shim:c", cgroup_layout(tmp_path, v2=False))
    assert (tmp_path / "cpu" / "system.slice" / "cri-shim-c.scope").exists()


class RecordingOci:
    """The runtime's command line, as far as a kind's delete goes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list[tuple[str, bool]] = []

    async def delete(self, container_id: str, *, force: bool = False) -> None:
        self.calls.append((container_id, force))


def _runtime(tmp_path: Path, oci: RecordingOci) -> HandlerRuntime:
    kind = HandlerKind(Path("runc"))
    files = ContainerFiles(tmp_path / "state")
    return HandlerRuntime("runc", kind, oci, files, tmp_path / "cgroup")  # type: ignore[arg-type]


async def test_delete_from_runtime_forces_the_delete_and_removes_the_empty_cgroups(
    tmp_path: Path, host: HostLimits
) -> None:
    oci = RecordingOci(tmp_path / "root")
    runtime = _runtime(tmp_path, oci)
    runtime.host = host
    for hierarchy in ("cpu", "memory"):
        (tmp_path / "cgroup" / hierarchy / "pods" / "c1").mkdir(parents=True)
    meta = Meta(bundle=str(tmp_path / "bundle"), log_path="", cgroups_path="/pods/c1")
    await runtime.delete_from_runtime("c1", meta)
    assert oci.calls == [("c1", True)]
    assert not (tmp_path / "cgroup" / "cpu" / "pods" / "c1").exists()
    assert not (tmp_path / "cgroup" / "memory" / "pods" / "c1").exists()
    # A container that never got as far as its meta: the runtime is asked all the same.
    await runtime.delete_from_runtime("c2", None)
    assert oci.calls[-1] == ("c2", True)


def test_the_layout_follows_the_hosts_cgroup_version(tmp_path: Path, host: HostLimits) -> None:
    runtime = _runtime(tmp_path, RecordingOci(tmp_path / "root"))
    runtime.host = host
    assert runtime.host_limits() is host
    (tmp_path / "cgroup" / "cpu").mkdir(parents=True)
    assert runtime.cgroup_layout.directories("pods/c1") == [tmp_path / "cgroup/cpu/pods/c1"]
    runtime.host = dataclasses.replace(host, cgroup_v2=True)
    assert runtime.cgroup_layout.directories("pods/c1") == [tmp_path / "cgroup" / "pods" / "c1"]


def test_a_missing_binary_is_named(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match=r"conmon /no/such/conmon not found"):
        executable(Path("/no/such/conmon"), "conmon")
