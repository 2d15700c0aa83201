"""The usage of pods and containers: what ContainerStats, PodSandboxStats and
ListPodSandboxMetrics (and their List and Stream twins) report, read through the one
HostReader.

Pod-level CPU and memory are the sum of the pod's containers: there is no infra container,
so a pod uses exactly what its containers use. CPU rates come from the previous sample of
the same object, whichever of these calls took it; the samples of removed objects are
dropped after each listing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from cri_shim.inspection.cpu_rates import CpuRates
from cri_shim.inspection.host import (
    CgroupStats,
    ContainerFigures,
    HostReader,
    InterfaceCounters,
    LayerFigure,
    LayerUsage,
    NetnsCounters,
)
from cri_shim.logcontext import object_fields
from cri_shim.state.records import ContainerRecord, SandboxRecord

if TYPE_CHECKING:
    from cri_shim.runtime.conmon import RuntimeBackend

log = logging.getLogger("cri_shim.stats")

# Containers whose usage one worker thread reads at a time: a stream sends the first
# batch before it reads the next.
BATCH = 64
# Pods read by one worker thread at a time, with their containers and networks.
POD_BATCH = 16

# A container's cgroup counters (a running one's) and its writable layer's figure.
Read = tuple["CgroupStats | None", LayerFigure]

T = TypeVar("T")


class SandboxRecords(Protocol):
    def get(self, ref: str) -> SandboxRecord: ...
    def list(self) -> list[SandboxRecord]: ...
    def ids(self) -> set[str]: ...


class ContainerRecords(Protocol):
    def get(self, ref: str) -> ContainerRecord: ...
    def list(self, sandbox_id: str | None = None) -> list[ContainerRecord]: ...
    def ids(self) -> set[str]: ...


@dataclass(frozen=True)
class ContainerUsage:
    record: ContainerRecord
    cgroup: CgroupStats | None  # a running container's only
    cpu_nano_cores: int | None  # since its previous sample; None for the first
    layer: LayerUsage
    layer_read_at: int  # nanoseconds since the epoch


@dataclass(frozen=True)
class PodNetwork:
    read_at: int  # nanoseconds since the epoch
    interfaces: dict[str, InterfaceCounters]  # every interface but loopback, never empty


@dataclass(frozen=True)
class PodUsage:
    record: SandboxRecord
    containers: list[ContainerUsage]
    read_at: int  # the latest of its containers' samples; 0 when none has a cgroup
    cpu_usage_ns: int
    cpu_nano_cores: int | None
    memory_working_set_bytes: int
    network: PodNetwork | None  # None for a host-network or stopped pod
    # The pod's own cgroup (memory, its limit, processes): None where there is none to
    # read (HostReader.pod_usage).
    cgroup: CgroupStats | None = None


@dataclass(frozen=True)
class PodFigures:
    """What a ready pod's metrics are made of: its network and its running containers."""

    record: SandboxRecord
    interfaces: dict[str, InterfaceCounters]
    containers: list[ContainerFigures]


class UsageCollector:
    """Reads usage for the stats and metrics RPCs and keeps the CPU samples between them."""

    def __init__(
        self,
        sandboxes: SandboxRecords,
        containers: ContainerRecords,
        reader: HostReader,
        rates: CpuRates | None = None,
    ) -> None:
        self._sandboxes = sandboxes
        self._containers = containers
        self._reader = reader
        self._rates = rates if rates is not None else CpuRates()

    async def container(self, ref: str) -> ContainerUsage:
        [usage] = await self._read_containers([self._containers.get(ref)])
        return usage

    async def containers(self, selected: list[ContainerRecord]) -> AsyncIterator[ContainerUsage]:
        """The usage of each of `selected`, a batch at a time when it is the batch's turn;
        then the CPU samples of removed objects are dropped."""
        for start in range(0, len(selected), BATCH):
            for usage in await self._read_containers(selected[start : start + BATCH]):
                yield usage
        self._forget_removed()

    async def pod(self, ref: str) -> PodUsage:
        sandbox = self._sandboxes.get(ref)
        [usage] = await self._read_pods([sandbox], self._containers.list(sandbox_id=sandbox.id))
        return usage

    async def pods(self, selected: list[SandboxRecord]) -> AsyncIterator[PodUsage]:
        """The usage of each of `selected`, a batch of pods at a time when it is the
        batch's turn; then the CPU samples of removed objects are dropped."""
        # One look at every container rather than one per pod (or batch).
        containers: dict[str, list[ContainerRecord]] = {s.id: [] for s in selected}
        for container in self._containers.list():
            if container.sandbox_id in containers:
                containers[container.sandbox_id].append(container)
        for start in range(0, len(selected), POD_BATCH):
            batch = selected[start : start + POD_BATCH]
            theirs = [c for s in batch for c in containers[s.id]]
            for usage in await self._read_pods(batch, theirs):
                yield usage
        self._forget_removed()

    async def pods_figures(self, render: Callable[[PodFigures], T]) -> AsyncIterator[T]:
        """Each ready pod's figures, read and given to `render` in one worker thread
        when it is the pod's turn (a stopped pod has no processes and no network left to
        measure)."""
        for sandbox in self._sandboxes.list():
            if not sandbox.ready:
                continue
            containers = self._containers.list(sandbox_id=sandbox.id)
            # cgroup files and a namespace switch: off the event loop.
            yield await asyncio.to_thread(self._render_pod, render, sandbox, containers)

    async def _read_containers(self, containers: list[ContainerRecord]) -> list[ContainerUsage]:
        """All read in one worker thread: the hop to a thread and back costs more than one
        container's files, so one hop each would make a node's listing mostly hops."""
        read = await asyncio.to_thread(self._read_usage, self._with_backends(containers))
        return [self._container_usage(c, cgroup, layer) for c, (cgroup, layer) in read]

    async def _read_pods(
        self, sandboxes: list[SandboxRecord], containers: list[ContainerRecord]
    ) -> list[PodUsage]:
        """The pods' `containers` and networks, all read in one worker thread (and the
        networks by one thread of its own, netdev.py)."""
        # A stopped pod's network is gone (or going): not read.
        networked = [s for s in sandboxes if s.netns_path is not None and s.ready]
        backends = self._with_backends(containers)
        reader = self._reader

        def read() -> tuple[
            list[tuple[ContainerRecord, Read]],
            dict[str, NetnsCounters],
            dict[str, CgroupStats | None],
        ]:
            pods = {
                s.id: reader.pod_usage(s, [b for b in backends if b[0].sandbox_id == s.id])
                for s in sandboxes
            }
            return self._read_usage(backends), reader.pods_interfaces(networked), pods

        usages, networks, pod_cgroups = await asyncio.to_thread(read)
        by_pod: dict[str, list[ContainerUsage]] = {s.id: [] for s in sandboxes}
        for container, (cgroup, layer) in usages:
            by_pod[container.sandbox_id].append(self._container_usage(container, cgroup, layer))
        return [
            self._pod_usage(s, by_pod[s.id], networks.get(s.id), pod_cgroups[s.id])
            for s in sandboxes
        ]

    def _with_backends(
        self, containers: list[ContainerRecord]
    ) -> list[tuple[ContainerRecord, RuntimeBackend | None]]:
        """Each container with its handler if it runs (read on the loop: the database)."""
        return [(c, self._reader.running_backend(c)) for c in containers]

    def _read_usage(
        self, containers: list[tuple[ContainerRecord, RuntimeBackend | None]]
    ) -> list[tuple[ContainerRecord, Read]]:
        """Blocking: in a worker thread."""
        return [(c, self._reader.container_usage(c, backend)) for c, backend in containers]

    def _container_usage(
        self, container: ContainerRecord, cgroup: CgroupStats | None, layer: LayerFigure
    ) -> ContainerUsage:
        rate = None
        if cgroup is not None and cgroup.cpu_usage_ns is not None:
            rate = self._rates.rate(container.id, cgroup.timestamp_ns, cgroup.cpu_usage_ns)
        return ContainerUsage(container, cgroup, rate, layer.usage, layer.read_at)

    def _pod_usage(
        self,
        sandbox: SandboxRecord,
        containers: list[ContainerUsage],
        network: NetnsCounters | None,
        cgroup: CgroupStats | None = None,
    ) -> PodUsage:
        sampled = [c.cgroup for c in containers if c.cgroup is not None]
        cpu = sum(c.cpu_usage_ns or 0 for c in sampled)
        read_at = max((c.timestamp_ns for c in sampled), default=0)
        return PodUsage(
            record=sandbox,
            containers=containers,
            read_at=read_at,
            cpu_usage_ns=cpu,
            cpu_nano_cores=self._rates.rate(sandbox.id, read_at, cpu) if read_at else None,
            memory_working_set_bytes=sum(c.memory_working_set_bytes or 0 for c in sampled),
            network=self._pod_network(sandbox, network),
            cgroup=cgroup,
        )

    def _pod_network(self, sandbox: SandboxRecord, read: NetnsCounters | None) -> PodNetwork | None:
        interfaces = _interfaces_read(sandbox, read, "stats")
        return PodNetwork(read.read_at, interfaces) if read and interfaces else None

    def _render_pod(
        self,
        render: Callable[[PodFigures], T],
        sandbox: SandboxRecord,
        containers: list[ContainerRecord],
    ) -> T:
        return render(self._pod_figures(sandbox, containers))

    def _pod_figures(self, sandbox: SandboxRecord, containers: list[ContainerRecord]) -> PodFigures:
        read = self._reader.pods_interfaces([sandbox]).get(sandbox.id)
        interfaces = _interfaces_read(sandbox, read, "metrics")
        running = [c for c in containers if c.state == "running"]
        figures = [self._reader.container_figures(c) for c in running]
        return PodFigures(sandbox, interfaces, [f for f in figures if f is not None])

    def _forget_removed(self) -> None:
        live: Set[str] = self._sandboxes.ids() | self._containers.ids()
        self._rates.retain(live)
        self._reader.retain(live)


def _interfaces_read(
    sandbox: SandboxRecord, read: NetnsCounters | None, what: str
) -> dict[str, InterfaceCounters]:
    """The pod's interface counters; none when it has no network or it could not be read
    (logged: the rest of the pod's `what` is still answered)."""
    if read is None:
        return {}
    if read.error is not None:
        log.warning(
            "network %s of pod %s: %s",
            what,
            sandbox.id,
            read.error,
            extra=object_fields("sandbox", sandbox.id, sandbox.name),
        )
    return read.interfaces
