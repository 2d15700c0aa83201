"""The one reader of what pods and containers use on the host: their cgroup files (through
the runtime handler that made them), the pod's network namespace and the writable
layer's filesystem. Stats, metrics and their streams all read through it.

Every method blocks on the host's files: call them from a worker thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cri_shim.errors import CriError
from cri_shim.inspection.layer_usage import LayerFigure as LayerFigure
from cri_shim.inspection.layer_usage import LayerUsageCache
from cri_shim.network.netdev import InterfaceCounters as InterfaceCounters
from cri_shim.network.netdev import NetnsCounters as NetnsCounters
from cri_shim.network.netdev import read_netns_counters
from cri_shim.runtime.cgroup_metrics import CgroupFigures as CgroupFigures
from cri_shim.runtime.cgroup_metrics import block_device_name, count_descriptors
from cri_shim.runtime.stats import CgroupStats as CgroupStats
from cri_shim.runtime.stats import LayerUsage as LayerUsage
from cri_shim.runtime.stats import PressureStall as PressureStall
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
    cgroup is, and which cgroup version the host runs), and the writable layers through
    `layers`, which walks each at most once per its `max_age`."""

    def __init__(
        self,
        backend_of: Callable[[ContainerRecord], RuntimeBackend],
        layers: LayerUsageCache,
    ) -> None:
        self._backend_of = backend_of
        self.layers = layers
        # Where each running container's cgroup is, kept after the first read of its
        # runtime's files: it is fixed when the container is made.
        self._cgroups: dict[str, str] = {}

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
    ) -> tuple[CgroupStats | None, LayerFigure]:
        """A container's cgroup counters (a running one's: `backend` from
        running_backend) and the disk use of its writable layer."""
        cgroup = None
        if backend is not None and (path := self._cgroup_of(container, backend)) is not None:
            cgroup = backend.cgroup_layout.stats(path)
        return cgroup, self.layers.usage(container.id, container.bundle_dir / "upper")

    def _cgroup_of(self, container: ContainerRecord, backend: RuntimeBackend) -> str | None:
        path = self._cgroups.get(container.id)
        if path is None and (path := backend.cgroups_path(container.id)) is not None:
            self._cgroups[container.id] = path
        return path

    def pod_usage(
        self,
        sandbox: SandboxRecord,
        containers: list[tuple[ContainerRecord, RuntimeBackend | None]],
    ) -> CgroupStats | None:
        """The counters of the pod's own cgroup, the one kubelet made and named in
        `cgroup_parent` (holding its containers' and bounded by the pod's limits), read
        where its running containers' cgroups are. None for a pod without a parent of
        its own (its containers' cgroups share a directory with other pods') or without
        a running container."""
        if not sandbox.config.linux.cgroup_parent:
            return None
        for container, backend in containers:
            if backend is not None and (path := self._cgroup_of(container, backend)):
                parent = os.path.dirname(path.rstrip("/"))
                if parent and parent != "/":
                    return backend.cgroup_layout.stats(parent)
        return None

    def retain(self, live: Collection[str]) -> None:
        """Forget what was kept of containers not in `live` (removed ones)."""
        self.layers.retain(live)
        for container_id in [c for c in list(self._cgroups) if c not in live]:
            self._cgroups.pop(container_id, None)

    def container_figures(self, container: ContainerRecord) -> ContainerFigures | None:
        """cAdvisor's figures of a running container; None when it has no cgroup."""
        backend = self._backend_of(container)
        path = backend.cgroups_path(container.id)
        if path is None:
            return None
        figures = backend.cgroup_layout.figures(path)
        devices = set(figures.io_bytes) | set(figures.io_ops)
        return ContainerFigures(
            record=container,
            figures=figures,
            filesystem=self.layer_filesystem(container),
            descriptors=count_descriptors(figures.pids),
            seen_at=int(time.time()),
            device_names={device: block_device_name(*device) for device in devices},
        )

    def pods_interfaces(self, sandboxes: list[SandboxRecord]) -> dict[str, NetnsCounters]:
        """The counters of each pod's interfaces but loopback, by pod ID, read inside its
        network namespace (all of them by one thread); none for a host-network pod."""
        pinned = {s.id: s.netns_path for s in sandboxes if s.netns_path is not None}
        read = read_netns_counters(list(pinned.values())) if pinned else []
        return dict(zip(pinned, read, strict=True))

    def layer_filesystem(self, container: ContainerRecord) -> Filesystem | None:
        upper = container.bundle_dir / "upper"
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
            usage_bytes=self.layers.usage(container.id, upper).usage.used_bytes,
        )
