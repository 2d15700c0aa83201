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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

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


@dataclass(frozen=True)
class _Container:
    name: str
    help: str
    kind: api_pb2.MetricType.ValueType
    value: Callable[[CgroupFigures, ContainerRecord], int | None]


def _seconds(ns: int | None) -> int | None:
    return ns // _NS_PER_SECOND if ns is not None else None


_CONTAINER_METRICS = (
    _Container(
        "container_cpu_usage_seconds_total",
        "Cumulative cpu time consumed in seconds.",
        COUNTER,
        lambda f, c: _seconds(f.cpu_usage_ns),
    ),
    _Container(
        "container_cpu_user_seconds_total",
        "Cumulative user cpu time consumed in seconds.",
        COUNTER,
        lambda f, c: _seconds(f.cpu_user_ns),
    ),
    _Container(
        "container_cpu_system_seconds_total",
        "Cumulative system cpu time consumed in seconds.",
        COUNTER,
        lambda f, c: _seconds(f.cpu_system_ns),
    ),
    _Container(
        "container_memory_usage_bytes",
        "Current memory usage in bytes, including all memory regardless of when it was accessed",
        GAUGE,
        lambda f, c: f.memory_usage_bytes,
    ),
    _Container(
        "container_memory_working_set_bytes",
        "Current working set in bytes.",
        GAUGE,
        lambda f, c: f.memory_working_set_bytes,
    ),
    _Container(
        "container_memory_rss",
        "Size of RSS in bytes.",
        GAUGE,
        lambda f, c: f.memory_rss_bytes,
    ),
    _Container(
        "container_memory_cache",
        "Number of bytes of page cache memory.",
        GAUGE,
        lambda f, c: f.memory_cache_bytes,
    ),
    _Container(
        "container_memory_max_usage_bytes",
        "Maximum memory usage recorded in bytes",
        GAUGE,
        lambda f, c: f.memory_max_usage_bytes,
    ),
    _Container(
        "container_spec_memory_limit_bytes",
        "Memory limit for the container.",
        GAUGE,
        lambda f, c: f.memory_limit_bytes,
    ),
    _Container(
        "container_oom_events_total",
        "Count of out of memory events observed for the container",
        COUNTER,
        lambda f, c: f.oom_kills,
    ),
    _Container(
        "container_processes",
        "Number of processes running inside the container.",
        GAUGE,
        lambda f, c: f.processes,
    ),
    _Container(
        "container_threads",
        "Number of threads running inside the container",
        GAUGE,
        lambda f, c: f.threads,
    ),
    _Container(
        "container_start_time_seconds",
        "Start time of the container since unix epoch in seconds.",
        GAUGE,
        lambda f, c: _seconds(c.started_at) if c.started_at else None,
    ),
)

_NETWORK_METRICS: tuple[tuple[str, str, str], ...] = (
    ("container_network_receive_bytes_total", "Cumulative count of bytes received", "rx_bytes"),
    (
        "container_network_receive_packets_total",
        "Cumulative count of packets received",
        "rx_packets",
    ),
    (
        "container_network_receive_errors_total",
        "Cumulative count of errors encountered while receiving",
        "rx_errors",
    ),
    (
        "container_network_receive_packets_dropped_total",
        "Cumulative count of packets dropped while receiving",
        "rx_dropped",
    ),
    ("container_network_transmit_bytes_total", "Cumulative count of bytes transmitted", "tx_bytes"),
    (
        "container_network_transmit_packets_total",
        "Cumulative count of packets transmitted",
        "tx_packets",
    ),
    (
        "container_network_transmit_errors_total",
        "Cumulative count of errors encountered while transmitting",
        "tx_errors",
    ),
    (
        "container_network_transmit_packets_dropped_total",
        "Cumulative count of packets dropped while transmitting",
        "tx_dropped",
    ),
)


def metric_descriptors() -> list[api_pb2.MetricDescriptor]:
    return [
        api_pb2.MetricDescriptor(name=m.name, help=m.help, label_keys=LABELS)
        for m in _CONTAINER_METRICS
    ] + [
        api_pb2.MetricDescriptor(name=name, help=text, label_keys=NETWORK_LABELS)
        for name, text, _ in _NETWORK_METRICS
    ]


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
    metrics = api_pb2.PodSandboxMetrics(pod_sandbox_id=sandbox.id)
    if sandbox.netns_path is not None:
        try:
            interfaces = read_netns_counters(sandbox.netns_path)
        except (OSError, TimeoutError) as err:
            log.warning("network metrics of pod %s: %s", sandbox.id, err)
            interfaces = {}
        labels = ["POD", sandbox.id, "", sandbox.name, meta.namespace, meta.name]
        metrics.metrics.extend(_network(labels, interfaces))
    for container in containers:
        if container.state != "running":
            continue
        backend = services.containers.backend_of(container)
        path = backend.cgroups_path(container.id)
        if path is None:
            continue
        figures = read_cgroup_figures(path, backend.cgroup_root, cgroup_v2=backend.cgroup_v2)
        labels = [
            container.config.metadata.name,
            container.id,
            container.image_ref,
            container.name,
            meta.namespace,
            meta.name,
        ]
        values = [
            api_pb2.Metric(
                name=m.name,
                metric_type=m.kind,
                label_values=labels,
                value=api_pb2.UInt64Value(value=value),
            )
            for m in _CONTAINER_METRICS
            if (value := m.value(figures, container)) is not None
        ]
        metrics.container_metrics.append(
            api_pb2.ContainerMetrics(container_id=container.id, metrics=values)
        )
    return metrics


def _network(labels: list[str], interfaces: dict[str, InterfaceCounters]) -> list[api_pb2.Metric]:
    out = []
    for interface, counters in sorted(interfaces.items()):
        for name, _help, attribute in _NETWORK_METRICS:
            out.append(
                api_pb2.Metric(
                    name=name,
                    metric_type=COUNTER,
                    label_values=[*labels, interface],
                    value=api_pb2.UInt64Value(value=getattr(counters, attribute)),
                )
            )
    return out
