"""The one reader of what pods and containers use on the host: their cgroup files (through
the runtime handler that made them), the pod's network namespace and the writable
layer's filesystem. Stats, metrics and their streams all read through it.

Every method blocks on the host's files: call them from a worker thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cri_shim.errors import CriError
from cri_shim.network.netdev import InterfaceCounters as InterfaceCounters
from cri_shim.network.netdev import read_netns_counters
from cri_shim.runtime.cgroup_metrics import CgroupFigures as CgroupFigures
from cri_shim.runtime.cgroup_metrics import (
    block_device_name,
    count_descriptors,
    read_cgroup_figures,
)
from cri_shim.runtime.stats import CgroupStats as CgroupStats
from cri_shim.runtime.stats import LayerUsage as LayerUsage
from cri_shim.runtime.stats import read_cgroup_stats, writable_layer_usage
from cri_shim.state.records import ContainerRecord, SandboxRecord

if TYPE_CHECKING:
    from cri_shim.runtime.conmon import RuntimeBackend

Device = tuple[int, int]  # (major, minor)


@dataclass(frozen=True)
class Filesystem:
    """The filesystem that holds a container's writable layer."""

    device: str
    limit_bytes: int
    inodes_total: int
    inodes_free: int
    usage_bytes: int


@dataclass(frozen=True)
class ContainerFigures:
    """What a running container's metrics are made of."""

    record: ContainerRecord
    figures: CgroupFigures
    filesystem: Filesystem | None
    descriptors: tuple[int, int]  # open files, sockets
    seen_at: int  # seconds since the epoch
    device_names: Mapping[Device, str]  # the block devices its I/O figures name


class HostReader:
    """Reads through `backend_of`, the runtime handler that made a container (where its
    cgroup is, and which cgroup version the host runs)."""

    def __init__(self, backend_of: Callable[[ContainerRecord], RuntimeBackend]) -> None:
        self._backend_of = backend_of

    def running_backend(self, container: ContainerRecord) -> RuntimeBackend | None:
        """The handler of a running container; None for any other (no cgroup to read).
        Not blocking: it reads the state database, which belongs to the event loop."""
        if container.state != "running":
            return None
        try:
            return self._backend_of(container)
        except CriError:
            return None

    def container_usage(
        self, container: ContainerRecord, backend: RuntimeBackend | None
    ) -> tuple[CgroupStats | None, LayerUsage]:
        """A container's cgroup counters (a running one's: `backend` from
        running_backend) and the disk use of its writable layer."""
        cgroup = None
        if backend is not None and (path := backend.cgroups_path(container.id)) is not None:
            cgroup = read_cgroup_stats(path, backend.cgroup_root, cgroup_v2=backend.cgroup_v2)
        return cgroup, writable_layer_usage(container.bundle_dir / "upper")

    def container_figures(self, container: ContainerRecord) -> ContainerFigures | None:
        """cAdvisor's figures of a running container; None when it has no cgroup."""
        backend = self._backend_of(container)
        path = backend.cgroups_path(container.id)
        if path is None:
            return None
        figures = read_cgroup_figures(path, backend.cgroup_root, cgroup_v2=backend.cgroup_v2)
        devices = set(figures.io_bytes) | set(figures.io_ops)
        return ContainerFigures(
            record=container,
            figures=figures,
            filesystem=self.layer_filesystem(container.bundle_dir / "upper"),
            descriptors=count_descriptors(figures.pids),
            seen_at=int(time.time()),
            device_names={device: block_device_name(*device) for device in devices},
        )

    def pod_interfaces(self, sandbox: SandboxRecord) -> dict[str, InterfaceCounters]:
        """The counters of the pod's interfaces but loopback, read inside its network
        namespace; none for a host-network pod. Raises OSError or TimeoutError."""
        if sandbox.netns_path is None:
            return {}
        return read_netns_counters(sandbox.netns_path)

    def layer_filesystem(self, upper: Path) -> Filesystem | None:
        try:
            info = os.statvfs(upper)
            device = upper.stat().st_dev
        except OSError:
            return None
        return Filesystem(
            device=block_device_name(os.major(device), os.minor(device)),
            limit_bytes=info.f_blocks * info.f_frsize,
            inodes_total=info.f_files,
            inodes_free=info.f_ffree,
            usage_bytes=writable_layer_usage(upper).used_bytes,
        )
