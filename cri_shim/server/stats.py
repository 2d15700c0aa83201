"""ContainerStats, PodSandboxStats and their List and Stream RPCs (cgroup files, and
the pod's interfaces read inside its network namespace).

Pod-level CPU and memory are the sum of the pod's containers: there is no infra container,
so a pod uses exactly what its containers use. CPU rates come from the previous sample of
the same object (services.cpu_rates), whichever of these calls took it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import CriError
from cri_shim.network.netdev import InterfaceCounters, read_netns_counters
from cri_shim.runtime.stats import writable_layer_usage
from cri_shim.server import listing
from cri_shim.state.records import ContainerRecord, SandboxRecord

if TYPE_CHECKING:
    from cri_shim.runtime.conmon import RuntimeBackend
    from cri_shim.runtime.stats import CgroupStats, LayerUsage
    from cri_shim.server.components import Components

log = logging.getLogger("cri_shim.stats")

# The interface kubelet reports as the pod's network (its summary API's `network.name`).
DEFAULT_INTERFACE = "eth0"
# Containers whose stats one worker thread reads at a time: a stream sends the first
# batch before it reads the next.
_STATS_BATCH = 64


def _u64(value: int | None) -> api_pb2.UInt64Value | None:
    return api_pb2.UInt64Value(value=value) if value is not None else None


@dataclass(frozen=True)
class _Usage:
    """What a container's stats read from the host: its cgroup's counters (a running
    container's only) and its writable layer."""

    cgroup: CgroupStats | None
    layer: LayerUsage


def _read_usage(backend: RuntimeBackend | None, container: ContainerRecord) -> _Usage:
    """In a worker thread: cgroup files and the walk of the layer are the host's I/O."""
    cgroup = None
    if backend is not None:
        try:
            cgroup = backend.cgroup_stats(container.id)
        except CriError:
            pass
    return _Usage(cgroup, writable_layer_usage(container.bundle_dir / "upper"))


def _backend_if_running(services: Components, container: ContainerRecord) -> RuntimeBackend | None:
    if container.state != "running":
        return None
    try:
        return services.containers.backend_of(container)
    except CriError:
        return None


async def _read_usages(services: Components, containers: list[ContainerRecord]) -> list[_Usage]:
    """The usage of each of `containers`, all read in one worker thread: the hop to a
    thread and back costs more than one container's files, so one hop each would make
    a node's listing mostly hops."""
    backends = [_backend_if_running(services, c) for c in containers]
    return await asyncio.to_thread(
        lambda: [_read_usage(b, c) for b, c in zip(backends, containers, strict=True)]
    )


def _container_stats(
    services: Components, container: ContainerRecord, usage: _Usage
) -> api_pb2.ContainerStats:
    attributes = api_pb2.ContainerAttributes(
        id=container.id,
        metadata=container.config.metadata,
        labels=container.config.labels,
        annotations=container.config.annotations,
    )
    stats = api_pb2.ContainerStats(attributes=attributes)
    if (cg := usage.cgroup) is not None:
        stats.cpu.CopyFrom(
            api_pb2.CpuUsage(
                timestamp=cg.timestamp_ns,
                usage_core_nano_seconds=_u64(cg.cpu_usage_ns),
                usage_nano_cores=_u64(
                    services.cpu_rates.rate(container.id, cg.timestamp_ns, cg.cpu_usage_ns)
                    if cg.cpu_usage_ns is not None
                    else None
                ),
            )
        )
        stats.memory.CopyFrom(
            api_pb2.MemoryUsage(
                timestamp=cg.timestamp_ns,
                working_set_bytes=_u64(cg.memory_working_set_bytes),
                usage_bytes=_u64(cg.memory_usage_bytes),
                rss_bytes=_u64(cg.memory_rss_bytes),
                page_faults=_u64(cg.page_faults),
                major_page_faults=_u64(cg.major_page_faults),
            )
        )
    stats.writable_layer.CopyFrom(
        api_pb2.FilesystemUsage(
            # kubelet dates the figures by it: without one they would read as of 1970.
            timestamp=time.time_ns(),
            fs_id=api_pb2.FilesystemIdentifier(mountpoint=str(services.config.root)),
            used_bytes=_u64(usage.layer.used_bytes),
            inodes_used=_u64(usage.layer.inodes_used),
        )
    )
    return stats


async def _containers_stats(
    services: Components, containers: list[ContainerRecord]
) -> list[api_pb2.ContainerStats]:
    usages = await _read_usages(services, containers)
    return [_container_stats(services, c, u) for c, u in zip(containers, usages, strict=True)]


async def container_stats(
    services: Components, request: api_pb2.ContainerStatsRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ContainerStatsResponse:
    container = services.containers.get(request.container_id)
    [stats] = await _containers_stats(services, [container])
    return api_pb2.ContainerStatsResponse(stats=stats)


async def container_stats_listed(
    services: Components, f: api_pb2.ContainerStatsFilter
) -> AsyncIterator[api_pb2.ContainerStats]:
    """The stats of the containers `f` selects, read a batch at a time when it is the
    batch's turn: ListContainerStats and StreamContainerStats. Then the CPU samples of
    removed objects are dropped."""
    selected = [
        c
        for c in services.containers.list(sandbox_id=f.pod_sandbox_id or None)
        if (not f.id or c.id.startswith(f.id))
        and all(c.config.labels.get(k) == v for k, v in f.label_selector.items())
    ]
    for start in range(0, len(selected), _STATS_BATCH):
        for stats in await _containers_stats(services, selected[start : start + _STATS_BATCH]):
            yield stats
    _forget_removed(services)


async def list_container_stats(
    services: Components,
    request: api_pb2.ListContainerStatsRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ListContainerStatsResponse:
    stats = await listing.collect(
        container_stats_listed(services, request.filter),
        "ListContainerStats",
        "StreamContainerStats",
        listing.reply_limit(services.config),
    )
    return api_pb2.ListContainerStatsResponse(stats=stats)


async def stream_container_stats(
    services: Components,
    request: api_pb2.StreamContainerStatsRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        container_stats_listed(services, request.filter),
        context,
        lambda stats: api_pb2.StreamContainerStatsResponse(container_stats=[stats]),
    )


async def _sandbox_stats(services: Components, sandbox_id: str) -> api_pb2.PodSandboxStats:
    sandbox = services.sandboxes.get(sandbox_id)
    containers = await _containers_stats(services, services.containers.list(sandbox_id=sandbox.id))
    cpu = sum(c.cpu.usage_core_nano_seconds.value for c in containers)
    memory = sum(c.memory.working_set_bytes.value for c in containers)
    timestamp = max((c.cpu.timestamp for c in containers), default=0)
    rate = services.cpu_rates.rate(sandbox.id, timestamp, cpu) if timestamp else None
    return api_pb2.PodSandboxStats(
        attributes=api_pb2.PodSandboxAttributes(
            id=sandbox.id,
            metadata=sandbox.config.metadata,
            labels=sandbox.config.labels,
            annotations=sandbox.config.annotations,
        ),
        linux=api_pb2.LinuxPodSandboxStats(
            cpu=api_pb2.CpuUsage(
                timestamp=timestamp, usage_core_nano_seconds=_u64(cpu), usage_nano_cores=_u64(rate)
            ),
            memory=api_pb2.MemoryUsage(timestamp=timestamp, working_set_bytes=_u64(memory)),
            network=await _network_usage(sandbox),
            containers=containers,
        ),
    )


async def _network_usage(sandbox: SandboxRecord) -> api_pb2.NetworkUsage | None:
    """The pod's interfaces but loopback; none for a host-network or stopped pod (whose
    network is the node's, or gone)."""
    if sandbox.netns_path is None or not sandbox.ready:
        return None
    timestamp = time.time_ns()
    try:
        interfaces = await asyncio.to_thread(read_netns_counters, sandbox.netns_path)
    except (OSError, TimeoutError) as err:
        log.warning("network stats of pod %s: %s", sandbox.id, err)
        return None
    if not interfaces:
        return None
    usage = [_interface_usage(name, c) for name, c in sorted(interfaces.items())]
    default = next((u for u in usage if u.name == DEFAULT_INTERFACE), usage[0])
    return api_pb2.NetworkUsage(timestamp=timestamp, default_interface=default, interfaces=usage)


def _interface_usage(name: str, counters: InterfaceCounters) -> api_pb2.NetworkInterfaceUsage:
    return api_pb2.NetworkInterfaceUsage(
        name=name,
        rx_bytes=_u64(counters.rx_bytes),
        rx_errors=_u64(counters.rx_errors),
        tx_bytes=_u64(counters.tx_bytes),
        tx_errors=_u64(counters.tx_errors),
    )


def _forget_removed(services: Components) -> None:
    """Drop the CPU samples of pods and containers that are gone."""
    services.cpu_rates.retain(services.sandboxes.ids() | services.containers.ids())


async def pod_sandbox_stats(
    services: Components, request: api_pb2.PodSandboxStatsRequest, context: grpc.aio.ServicerContext
) -> api_pb2.PodSandboxStatsResponse:
    return api_pb2.PodSandboxStatsResponse(
        stats=await _sandbox_stats(services, request.pod_sandbox_id)
    )


async def pod_sandbox_stats_listed(
    services: Components, f: api_pb2.PodSandboxStatsFilter
) -> AsyncIterator[api_pb2.PodSandboxStats]:
    """The stats of the pods `f` selects, each read when it is its turn:
    ListPodSandboxStats and StreamPodSandboxStats. Then the CPU samples of removed
    objects are dropped."""
    for s in services.sandboxes.list():
        if (not f.id or s.id.startswith(f.id)) and all(
            s.config.labels.get(k) == v for k, v in f.label_selector.items()
        ):
            yield await _sandbox_stats(services, s.id)
    _forget_removed(services)


async def list_pod_sandbox_stats(
    services: Components,
    request: api_pb2.ListPodSandboxStatsRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ListPodSandboxStatsResponse:
    stats = await listing.collect(
        pod_sandbox_stats_listed(services, request.filter),
        "ListPodSandboxStats",
        "StreamPodSandboxStats",
        listing.reply_limit(services.config),
    )
    return api_pb2.ListPodSandboxStatsResponse(stats=stats)


async def stream_pod_sandbox_stats(
    services: Components,
    request: api_pb2.StreamPodSandboxStatsRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        pod_sandbox_stats_listed(services, request.filter),
        context,
        lambda stats: api_pb2.StreamPodSandboxStatsResponse(pod_sandbox_stats=[stats]),
    )
