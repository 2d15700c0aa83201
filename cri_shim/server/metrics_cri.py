"""ListMetricDescriptors and ListPodSandboxMetrics: cAdvisor's container metrics over CRI.

kubelet (PodAndContainerStatsFromCRI) serves /metrics/cadvisor from these instead of
running cAdvisor. Names, help texts and label names follow cAdvisor, so dashboards and
alerts keep working. CRI carries integers: CPU seconds are whole seconds, as CRI-O sends
them. Values are read live at each call (timestamp 0, as the CRI asks for live values).

Container metrics come from each running container's cgroup; network metrics belong to
the pod (its network namespace), reported once per interface under the pod's own ID.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import grpc
from cri_api.v1 import api_pb2

from cri_shim.network.netdev import InterfaceCounters, read_netns_counters
from cri_shim.runtime.cgroup_metrics import CgroupFigures, read_cgroup_figures
from cri_shim.state.records import ContainerRecord, SandboxRecord

if TYPE_CHECKING:
    from cri_shim.daemon import Services

log = logging.getLogger("cri_shim.server")

LABELS = ("container", "id", "image", "name", "namespace", "pod")
NETWORK_LABELS = (*LABELS, "interface")
COUNTER, GAUGE = api_pb2.COUNTER, api_pb2.GAUGE
_NS_PER_SECOND = 1_000_000_000

_S = TypeVar("_S")


@dataclass(frozen=True)
class _Spec(Generic[_S]):
    """One metric, declared once. Both RPCs read it, so a descriptor cannot drift from the
    values it describes: the label values are looked up by the declared label keys."""

    name: str
    help: str
    kind: api_pb2.MetricType.ValueType
    labels: tuple[str, ...]
    read: Callable[[_S], int | None]

    def descriptor(self) -> api_pb2.MetricDescriptor:
        return api_pb2.MetricDescriptor(name=self.name, help=self.help, label_keys=self.labels)

    def sample(self, labels: Mapping[str, str], source: _S) -> api_pb2.Metric | None:
        """The live value (timestamp 0), or None where the source lacks the figure."""
        value = self.read(source)
        if value is None:
            return None
        return api_pb2.Metric(
            name=self.name,
            metric_type=self.kind,
            label_values=[labels[key] for key in self.labels],
            value=api_pb2.UInt64Value(value=value),
        )


class _Running(NamedTuple):
    """What a container's metrics are read from."""

    figures: CgroupFigures
    record: ContainerRecord


def _container(
    name: str, help: str, kind: api_pb2.MetricType.ValueType, read: Callable[[_Running], int | None]
) -> _Spec[_Running]:
    return _Spec(name, help, kind, LABELS, read)


def _network(
    name: str, help: str, read: Callable[[InterfaceCounters], int]
) -> _Spec[InterfaceCounters]:
    return _Spec(name, help, COUNTER, NETWORK_LABELS, read)


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
        "container_start_time_seconds",
        "Start time of the container since unix epoch in seconds.",
        GAUGE,
        lambda r: _seconds(r.record.started_at) if r.record.started_at else None,
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
    return [metric for spec in specs if (metric := spec.sample(labels, source)) is not None]


async def list_metric_descriptors(
    services: Services,
    request: api_pb2.ListMetricDescriptorsRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ListMetricDescriptorsResponse:
    return api_pb2.ListMetricDescriptorsResponse(descriptors=metric_descriptors())


async def list_pod_sandbox_metrics(
    services: Services,
    request: api_pb2.ListPodSandboxMetricsRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ListPodSandboxMetricsResponse:
    pods = []
    for sandbox in services.sandboxes.list():
        if not sandbox.ready:
            continue  # a stopped pod has no processes and no network left to measure
        containers = services.containers.list(sandbox_id=sandbox.id)
        # cgroup files and a namespace switch: off the event loop.
        pods.append(await asyncio.to_thread(_pod_metrics, services, sandbox, containers))
    return api_pb2.ListPodSandboxMetricsResponse(pod_metrics=pods)


def _pod_metrics(
    services: Services, sandbox: SandboxRecord, containers: list[ContainerRecord]
) -> api_pb2.PodSandboxMetrics:
    meta = sandbox.config.metadata
    pod = {"namespace": meta.namespace, "pod": meta.name}
    metrics = api_pb2.PodSandboxMetrics(pod_sandbox_id=sandbox.id)
    if sandbox.netns_path is not None:
        try:
            interfaces = read_netns_counters(sandbox.netns_path)
        except (OSError, TimeoutError) as err:
            log.warning("network metrics of pod %s: %s", sandbox.id, err)
            interfaces = {}
        labels = {**pod, "container": "POD", "id": sandbox.id, "image": "", "name": sandbox.name}
        for interface, counters in sorted(interfaces.items()):
            with_interface = {**labels, "interface": interface}
            metrics.metrics.extend(_samples(_NETWORK_METRICS, with_interface, counters))
    for container in containers:
        if container.state != "running":
            continue
        backend = services.containers.backend_of(container)
        path = backend.cgroups_path(container.id)
        if path is None:
            continue
        figures = read_cgroup_figures(path, backend.cgroup_root, cgroup_v2=backend.cgroup_v2)
        labels = {
            **pod,
            "container": container.config.metadata.name,
            "id": container.id,
            "image": container.image_ref,
            "name": container.name,
        }
        values = _samples(_CONTAINER_METRICS, labels, _Running(figures, container))
        metrics.container_metrics.append(
            api_pb2.ContainerMetrics(container_id=container.id, metrics=values)
        )
    return metrics
