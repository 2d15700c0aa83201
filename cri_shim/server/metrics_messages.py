"""cAdvisor's container metrics over CRI, declared and rendered for ListMetricDescriptors,
ListPodSandboxMetrics and StreamPodSandboxMetrics.

kubelet (PodAndContainerStatsFromCRI) serves /metrics/cadvisor from these instead of
running cAdvisor. Names, help texts and label names follow cAdvisor, so dashboards and
alerts keep working. CRI carries integers: CPU seconds are whole seconds, as CRI-O sends
them. Values are read live at each call (timestamp 0, as the CRI asks for live values),
by inspection/usage.py; this module only declares the metrics and renders them.

Container metrics come from each running container's cgroup; network metrics belong to
the pod (its network namespace), reported once per interface under the pod's own ID.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from cri_shim.api.v1 import api_pb2
from cri_shim.inspection.host import ContainerFigures, Filesystem, InterfaceCounters

if TYPE_CHECKING:
    from cri_shim.inspection.host import CgroupFigures, Device
    from cri_shim.inspection.usage import PodFigures

LABELS = ("container", "id", "image", "name", "namespace", "pod")
NETWORK_LABELS = (*LABELS, "interface")
COUNTER, GAUGE = api_pb2.COUNTER, api_pb2.GAUGE
_NS_PER_SECOND = 1_000_000_000

_S = TypeVar("_S")


@dataclass(frozen=True)
class _Spec(Generic[_S]):
    """One metric, declared once. Both RPCs read it, so a descriptor cannot drift from the
    values it describes: the label values are looked up by the declared label keys.
    `read` gives the metric's series: each with the values of the labels beyond the
    object's own (a device, an operation) and its value; none where the source lacks it."""

    name: str
    help: str
    kind: api_pb2.MetricType.ValueType
    labels: tuple[str, ...]
    read: Callable[[_S], Iterable[tuple[Mapping[str, str], int]]]

    def descriptor(self) -> api_pb2.MetricDescriptor:
        return api_pb2.MetricDescriptor(name=self.name, help=self.help, label_keys=self.labels)

    def samples(self, labels: Mapping[str, str], source: _S) -> Iterator[api_pb2.Metric]:
        """The live values (timestamp 0)."""
        for extra, value in self.read(source):
            values = {**labels, **extra}
            yield api_pb2.Metric(
                name=self.name,
                metric_type=self.kind,
                label_values=[values[key] for key in self.labels],
                value=api_pb2.UInt64Value(value=value),
            )


def _single(
    read: Callable[[_S], int | None],
) -> Callable[[_S], list[tuple[Mapping[str, str], int]]]:
    def series(source: _S) -> list[tuple[Mapping[str, str], int]]:
        value = read(source)
        return [] if value is None else [({}, value)]

    return series


def _container(
    name: str,
    help: str,
    kind: api_pb2.MetricType.ValueType,
    read: Callable[[ContainerFigures], int | None],
) -> _Spec[ContainerFigures]:
    return _Spec(name, help, kind, LABELS, _single(read))


def _on_filesystem(
    name: str, help: str, kind: api_pb2.MetricType.ValueType, read: Callable[[Filesystem], int]
) -> _Spec[ContainerFigures]:
    def series(r: ContainerFigures) -> list[tuple[Mapping[str, str], int]]:
        fs = r.filesystem
        return [] if fs is None else [({"device": fs.device}, read(fs))]

    return _Spec(name, help, kind, (*LABELS, "device"), series)


def _per_device(
    name: str,
    help: str,
    figures: Callable[[CgroupFigures], dict[Device, dict[str, int]]],
    operation: str,
) -> _Spec[ContainerFigures]:
    """A block I/O counter of one operation, per device (cAdvisor's container_fs_*)."""

    def series(r: ContainerFigures) -> list[tuple[Mapping[str, str], int]]:
        return [
            ({"device": r.device_names[device]}, ops[operation])
            for device, ops in sorted(figures(r.figures).items())
            if operation in ops
        ]

    return _Spec(name, help, COUNTER, (*LABELS, "device"), series)


def _blkio_usage(r: ContainerFigures) -> list[tuple[Mapping[str, str], int]]:
    return [
        (
            {
                "device": r.device_names[device],
                "major": str(device[0]),
                "minor": str(device[1]),
                "operation": operation,
            },
            value,
        )
        for device, ops in sorted(r.figures.io_bytes.items())
        for operation, value in sorted(ops.items())
    ]


def _page_faults(r: ContainerFigures) -> list[tuple[Mapping[str, str], int]]:
    return [
        ({"failure_type": fault, "scope": scope}, value)
        for (fault, scope), value in sorted(r.figures.page_faults.items())
    ]


def _network(
    name: str, help: str, read: Callable[[InterfaceCounters], int]
) -> _Spec[InterfaceCounters]:
    return _Spec(name, help, COUNTER, NETWORK_LABELS, _single(read))


def _seconds(ns: int | None) -> int | None:
    return ns // _NS_PER_SECOND if ns is not None else None


_CONTAINER_METRICS = (
    _container(
        "container_cpu_usage_seconds_total",
        "Cumulative cpu time consumed in seconds.",
        COUNTER,
        lambda r: _seconds(r.figures.cpu_usage_ns),
    ),
    _container(
        "container_cpu_user_seconds_total",
        "Cumulative user cpu time consumed in seconds.",
        COUNTER,
        lambda r: _seconds(r.figures.cpu_user_ns),
    ),
    _container(
        "container_cpu_system_seconds_total",
        "Cumulative system cpu time consumed in seconds.",
        COUNTER,
        lambda r: _seconds(r.figures.cpu_system_ns),
    ),
    _container(
        "container_cpu_cfs_periods_total",
        "Number of elapsed enforcement period intervals.",
        COUNTER,
        lambda r: r.figures.cpu_periods,
    ),
    _container(
        "container_cpu_cfs_throttled_periods_total",
        "Number of throttled period intervals.",
        COUNTER,
        lambda r: r.figures.cpu_throttled_periods,
    ),
    _container(
        "container_cpu_cfs_throttled_seconds_total",
        "Total time duration the container has been throttled.",
        COUNTER,
        lambda r: _seconds(r.figures.cpu_throttled_ns),
    ),
    _container(
        "container_memory_usage_bytes",
        "Current memory usage in bytes, including all memory regardless of when it was accessed",
        GAUGE,
        lambda r: r.figures.memory_usage_bytes,
    ),
    _container(
        "container_memory_working_set_bytes",
        "Current working set in bytes.",
        GAUGE,
        lambda r: r.figures.memory_working_set_bytes,
    ),
    _container(
        "container_memory_rss",
        "Size of RSS in bytes.",
        GAUGE,
        lambda r: r.figures.memory_rss_bytes,
    ),
    _container(
        "container_memory_cache",
        "Number of bytes of page cache memory.",
        GAUGE,
        lambda r: r.figures.memory_cache_bytes,
    ),
    _container(
        "container_memory_mapped_file",
        "Size of memory mapped files in bytes.",
        GAUGE,
        lambda r: r.figures.memory_mapped_file_bytes,
    ),
    _container(
        "container_memory_kernel_usage",
        "Size of kernel memory allocated in bytes.",
        GAUGE,
        lambda r: r.figures.memory_kernel_bytes,
    ),
    _container(
        "container_memory_swap",
        "Container swap usage in bytes.",
        GAUGE,
        lambda r: r.figures.memory_swap_bytes,
    ),
    _container(
        "container_memory_failcnt",
        "Number of memory usage hits limits",
        COUNTER,
        lambda r: r.figures.memory_failcnt,
    ),
    _Spec(
        "container_memory_failures_total",
        "Cumulative count of memory allocation failures.",
        COUNTER,
        (*LABELS, "failure_type", "scope"),
        _page_faults,
    ),
    _container(
        "container_memory_max_usage_bytes",
        "Maximum memory usage recorded in bytes",
        GAUGE,
        lambda r: r.figures.memory_max_usage_bytes,
    ),
    _container(
        "container_spec_memory_limit_bytes",
        "Memory limit for the container.",
        GAUGE,
        lambda r: r.figures.memory_limit_bytes,
    ),
    _container(
        "container_spec_memory_swap_limit_bytes",
        "Memory swap limit for the container.",
        GAUGE,
        lambda r: r.figures.memory_swap_limit_bytes,
    ),
    _container(
        "container_spec_cpu_period",
        "CPU period of the container.",
        GAUGE,
        lambda r: r.figures.cpu_period_us,
    ),
    _container(
        "container_spec_cpu_shares",
        "CPU share of the container.",
        GAUGE,
        lambda r: r.figures.cpu_shares,
    ),
    _container(
        "container_oom_events_total",
        "Count of out of memory events observed for the container",
        COUNTER,
        lambda r: r.figures.oom_kills,
    ),
    _container(
        "container_processes",
        "Number of processes running inside the container.",
        GAUGE,
        lambda r: r.figures.processes,
    ),
    _container(
        "container_threads",
        "Number of threads running inside the container",
        GAUGE,
        lambda r: r.figures.threads,
    ),
    _container(
        "container_threads_max",
        "Maximum number of threads allowed inside the container, infinity if value is zero",
        GAUGE,
        lambda r: r.figures.threads_max,
    ),
    _container(
        "container_file_descriptors",
        "Number of open file descriptors for the container.",
        GAUGE,
        lambda r: r.descriptors[0] if r.figures.pids else None,
    ),
    _container(
        "container_sockets",
        "Number of open sockets for the container.",
        GAUGE,
        lambda r: r.descriptors[1] if r.figures.pids else None,
    ),
    _on_filesystem(
        "container_fs_usage_bytes",
        "Number of bytes that are consumed by the container on this filesystem.",
        GAUGE,
        lambda fs: fs.usage_bytes,
    ),
    _on_filesystem(
        "container_fs_limit_bytes",
        "Number of bytes that can be consumed by the container on this filesystem.",
        GAUGE,
        lambda fs: fs.limit_bytes,
    ),
    _on_filesystem(
        "container_fs_inodes_total",
        "Number of available Inodes",
        GAUGE,
        lambda fs: fs.inodes_total,
    ),
    _on_filesystem(
        "container_fs_inodes_free",
        "Number of available Inodes",
        GAUGE,
        lambda fs: fs.inodes_free,
    ),
    _per_device(
        "container_fs_reads_bytes_total",
        "Cumulative count of bytes read",
        lambda f: f.io_bytes,
        "Read",
    ),
    _per_device(
        "container_fs_reads_total",
        "Cumulative count of reads completed",
        lambda f: f.io_ops,
        "Read",
    ),
    _per_device(
        "container_fs_writes_bytes_total",
        "Cumulative count of bytes written",
        lambda f: f.io_bytes,
        "Write",
    ),
    _per_device(
        "container_fs_writes_total",
        "Cumulative count of writes completed",
        lambda f: f.io_ops,
        "Write",
    ),
    _Spec(
        "container_blkio_device_usage_total",
        "Blkio Device bytes usage",
        COUNTER,
        (*LABELS, "device", "major", "minor", "operation"),
        _blkio_usage,
    ),
    _container(
        "container_start_time_seconds",
        "Start time of the container since unix epoch in seconds.",
        GAUGE,
        lambda r: _seconds(r.record.started_at) if r.record.started_at else None,
    ),
    _container(
        "container_last_seen",
        "Last time a container was seen by the exporter",
        GAUGE,
        lambda r: r.seen_at,
    ),
)

_NETWORK_METRICS = (
    _network(
        "container_network_receive_bytes_total",
        "Cumulative count of bytes received",
        lambda n: n.rx_bytes,
    ),
    _network(
        "container_network_receive_packets_total",
        "Cumulative count of packets received",
        lambda n: n.rx_packets,
    ),
    _network(
        "container_network_receive_errors_total",
        "Cumulative count of errors encountered while receiving",
        lambda n: n.rx_errors,
    ),
    _network(
        "container_network_receive_packets_dropped_total",
        "Cumulative count of packets dropped while receiving",
        lambda n: n.rx_dropped,
    ),
    _network(
        "container_network_transmit_bytes_total",
        "Cumulative count of bytes transmitted",
        lambda n: n.tx_bytes,
    ),
    _network(
        "container_network_transmit_packets_total",
        "Cumulative count of packets transmitted",
        lambda n: n.tx_packets,
    ),
    _network(
        "container_network_transmit_errors_total",
        "Cumulative count of errors encountered while transmitting",
        lambda n: n.tx_errors,
    ),
    _network(
        "container_network_transmit_packets_dropped_total",
        "Cumulative count of packets dropped while transmitting",
        lambda n: n.tx_dropped,
    ),
)


def metric_descriptors() -> list[api_pb2.MetricDescriptor]:
    return [spec.descriptor() for spec in (*_CONTAINER_METRICS, *_NETWORK_METRICS)]


def _samples(
    specs: Iterable[_Spec[_S]], labels: Mapping[str, str], source: _S
) -> list[api_pb2.Metric]:
    return [metric for spec in specs for metric in spec.samples(labels, source)]


def pod_metrics_message(pod: PodFigures) -> api_pb2.PodSandboxMetrics:
    sandbox = pod.record
    meta = sandbox.config.metadata
    labels = {"namespace": meta.namespace, "pod": meta.name}
    metrics = api_pb2.PodSandboxMetrics(pod_sandbox_id=sandbox.id)
    own = {**labels, "container": "POD", "id": sandbox.id, "image": "", "name": sandbox.name}
    for interface, counters in sorted(pod.interfaces.items()):
        metrics.metrics.extend(
            _samples(_NETWORK_METRICS, {**own, "interface": interface}, counters)
        )
    for running in pod.containers:
        container = running.record
        of_container = {
            **labels,
            "container": container.config.metadata.name,
            "id": container.id,
            "image": container.image_ref,
            "name": container.name,
        }
        values = _samples(_CONTAINER_METRICS, of_container, running)
        metrics.container_metrics.append(
            api_pb2.ContainerMetrics(container_id=container.id, metrics=values)
        )
    return metrics
