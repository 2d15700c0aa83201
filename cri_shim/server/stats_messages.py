"""The CRI messages of the usage that inspection/usage.py reads: a container's and a pod's
stats, shared by the stats RPCs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.inspection.host import CgroupStats, PressureStall
    from cri_shim.inspection.usage import ContainerUsage, PodNetwork, PodUsage
    from cri_shim.server.views import RuntimeView


# The interface kubelet reports as the pod's network (its summary API's `network.name`).
DEFAULT_INTERFACE = "eth0"


def _u64(value: int | None) -> api_pb2.UInt64Value | None:
    return api_pb2.UInt64Value(value=value) if value is not None else None


def container_stats_message(view: RuntimeView, usage: ContainerUsage) -> api_pb2.ContainerStats:
    container = usage.record
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
                usage_nano_cores=_u64(usage.cpu_nano_cores),
                psi=_psi(cg.pressure.get("cpu")),
            )
        )
        stats.memory.CopyFrom(_memory_usage(cg))
        if cg.swap_usage_bytes is not None:
            available = None
            if cg.swap_limit_bytes is not None:
                available = max(0, cg.swap_limit_bytes - cg.swap_usage_bytes)
            stats.swap.CopyFrom(
                api_pb2.SwapUsage(
                    timestamp=cg.timestamp_ns,
                    swap_usage_bytes=_u64(cg.swap_usage_bytes),
                    swap_available_bytes=_u64(available),
                )
            )
        if "io" in cg.pressure:
            stats.io.CopyFrom(
                api_pb2.IoUsage(timestamp=cg.timestamp_ns, psi=_psi(cg.pressure["io"]))
            )
    stats.writable_layer.CopyFrom(
        api_pb2.FilesystemUsage(
            # kubelet dates the figures by it: without one they would read as of 1970.
            timestamp=usage.layer_read_at,
            fs_id=api_pb2.FilesystemIdentifier(mountpoint=str(view.config.root)),
            used_bytes=_u64(usage.layer.used_bytes),
            inodes_used=_u64(usage.layer.inodes_used),
        )
    )
    return stats


def _memory_usage(cg: CgroupStats) -> api_pb2.MemoryUsage:
    return api_pb2.MemoryUsage(
        timestamp=cg.timestamp_ns,
        working_set_bytes=_u64(cg.memory_working_set_bytes),
        usage_bytes=_u64(cg.memory_usage_bytes),
        rss_bytes=_u64(cg.memory_rss_bytes),
        page_faults=_u64(cg.page_faults),
        major_page_faults=_u64(cg.major_page_faults),
        available_bytes=_u64(_available(cg)),
        psi=_psi(cg.pressure.get("memory")),
    )


def _available(cg: CgroupStats) -> int | None:
    """What the cgroup may still use before its memory limit, as kubelet's summary API
    counts it (limit minus working set); None without a limit of its own."""
    if cg.memory_limit_bytes is None or cg.memory_working_set_bytes is None:
        return None
    return max(0, cg.memory_limit_bytes - cg.memory_working_set_bytes)


def _psi(stall: PressureStall | None) -> api_pb2.PsiStats | None:
    """cgroup v2's pressure stall figures (total in microseconds, as the kernel counts)."""
    if stall is None:
        return None

    def data(line: tuple[int, float, float, float]) -> api_pb2.PsiData:
        total, avg10, avg60, avg300 = line
        return api_pb2.PsiData(Total=total, Avg10=avg10, Avg60=avg60, Avg300=avg300)

    return api_pb2.PsiStats(
        Some=data(stall.some), Full=data(stall.full) if stall.full is not None else None
    )


def pod_stats_message(view: RuntimeView, usage: PodUsage) -> api_pb2.PodSandboxStats:
    """A pod's stats: CPU summed over its containers; memory and processes those of the
    pod's own cgroup where it has one (PodUsage.cgroup), else the containers' working
    sets summed."""
    sandbox = usage.record
    memory = api_pb2.MemoryUsage(
        timestamp=usage.read_at, working_set_bytes=_u64(usage.memory_working_set_bytes)
    )
    process = None
    if (cg := usage.cgroup) is not None:
        memory = _memory_usage(cg)
        if cg.process_count is not None:
            process = api_pb2.ProcessUsage(
                timestamp=cg.timestamp_ns, process_count=_u64(cg.process_count)
            )
    return api_pb2.PodSandboxStats(
        attributes=api_pb2.PodSandboxAttributes(
            id=sandbox.id,
            metadata=sandbox.config.metadata,
            labels=sandbox.config.labels,
            annotations=sandbox.config.annotations,
        ),
        linux=api_pb2.LinuxPodSandboxStats(
            cpu=api_pb2.CpuUsage(
                timestamp=usage.read_at,
                usage_core_nano_seconds=_u64(usage.cpu_usage_ns),
                usage_nano_cores=_u64(usage.cpu_nano_cores),
            ),
            memory=memory,
            network=_network_usage(usage.network),
            process=process,
            containers=[container_stats_message(view, c) for c in usage.containers],
        ),
    )


def _network_usage(network: PodNetwork | None) -> api_pb2.NetworkUsage | None:
    if network is None:
        return None
    usage = [
        api_pb2.NetworkInterfaceUsage(
            name=name,
            rx_bytes=_u64(counters.rx_bytes),
            rx_errors=_u64(counters.rx_errors),
            tx_bytes=_u64(counters.tx_bytes),
            tx_errors=_u64(counters.tx_errors),
        )
        for name, counters in sorted(network.interfaces.items())
    ]
    default = next((u for u in usage if u.name == DEFAULT_INTERFACE), usage[0])
    return api_pb2.NetworkUsage(
        timestamp=network.read_at, default_interface=default, interfaces=usage
    )
