"""CRI metrics (ListMetricDescriptors, ListPodSandboxMetrics) against the real daemon: the
values move when a container burns CPU, fills memory, runs processes and gets traffic."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, ping, wait_until
from tests.integration.cri_testkit import container_config, create, import_image, pod, start

pytestmark = [pytest.mark.integration, pytest.mark.root]

MIB = 1 << 20


def _descriptors(daemon: Daemon) -> dict[str, api_pb2.MetricDescriptor]:
    response = daemon.runtime().ListMetricDescriptors(
        api_pb2.ListMetricDescriptorsRequest(), timeout=10
    )
    return {d.name: d for d in response.descriptors}


def _metrics(daemon: Daemon, sandbox_id: str) -> api_pb2.PodSandboxMetrics:
    response = daemon.runtime().ListPodSandboxMetrics(
        api_pb2.ListPodSandboxMetricsRequest(), timeout=10
    )
    return next(p for p in response.pod_metrics if p.pod_sandbox_id == sandbox_id)


def _value(metrics: list[api_pb2.Metric], name: str, **labels: str) -> int:
    keys = _LABEL_KEYS[name]
    for metric in metrics:
        if metric.name != name:
            continue
        values = dict(zip(keys, metric.label_values, strict=True))
        if all(values.get(k) == v for k, v in labels.items()):
            return metric.value.value
    raise AssertionError(f"no {name} with {labels}")


_LABEL_KEYS: dict[str, list[str]] = {}


def test_descriptors_name_cadvisor_metrics_with_their_labels(daemon: Daemon) -> None:
    descriptors = _descriptors(daemon)
    for name in (
        "container_cpu_usage_seconds_total",
        "container_memory_working_set_bytes",
        "container_processes",
        "container_network_receive_bytes_total",
    ):
        assert descriptors[name].help
    assert list(descriptors["container_memory_usage_bytes"].label_keys) == [
        "container",
        "id",
        "image",
        "name",
        "namespace",
        "pod",
    ]
    assert list(descriptors["container_network_transmit_bytes_total"].label_keys)[-1] == (
        "interface"
    )


def test_metrics_move_with_cpu_memory_processes_and_traffic(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    import_image(daemon, busybox_layout)
    _LABEL_KEYS.update({n: list(d.label_keys) for n, d in _descriptors(daemon).items()})
    with pod(daemon, "metered", short_tmp) as p:
        sandbox_id = p[0]
        # Idle first, then (on a signal file) burn CPU in two processes and put 64 MiB in
        # the pod's /dev/shm, which is charged to the container's memory cgroup.
        script = (
            "while [ ! -e /tmp/go ]; do sleep 0.1; done; "
            "(while :; do :; done) & (while :; do :; done) & "
            "dd if=/dev/zero of=/dev/shm/fill bs=1M count=64 2>/dev/null; sleep 300"
        )
        container_id = create(daemon, p, container_config("burner", script))
        start(daemon, container_id)

        before = _metrics(daemon, sandbox_id)
        (container,) = before.container_metrics
        assert container.container_id == container_id
        idle = list(container.metrics)
        assert _value(idle, "container_cpu_usage_seconds_total") < 1
        assert _value(idle, "container_memory_usage_bytes") < 32 * MIB
        assert _value(idle, "container_processes", container="burner", pod="metered") <= 2

        daemon.runtime().ExecSync(
            api_pb2.ExecSyncRequest(container_id=container_id, cmd=["touch", "/tmp/go"]),
            timeout=30,
        )

        def container_metrics() -> list[api_pb2.Metric]:
            return list(_metrics(daemon, sandbox_id).container_metrics[0].metrics)

        # CRI carries whole seconds: wait for two of them (the loops share the node's CPUs).
        wait_until(
            lambda: _value(container_metrics(), "container_cpu_usage_seconds_total") >= 2,
            timeout=20,
            interval=0.5,
        )
        after = container_metrics()
        assert _value(after, "container_cpu_user_seconds_total") >= 1
        assert _value(after, "container_memory_usage_bytes") >= 64 * MIB
        assert _value(after, "container_memory_max_usage_bytes") >= 64 * MIB
        assert _value(after, "container_processes") >= 3  # two loops and the sleep
        assert _value(after, "container_threads") >= 3
        assert _value(after, "container_start_time_seconds") > time.time() - 120

        # Network: the pod's own interface, read inside its namespace.
        status = daemon.runtime().PodSandboxStatus(
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=10
        )
        ip = status.status.network.ip
        received = _value(
            list(_metrics(daemon, sandbox_id).metrics),
            "container_network_receive_packets_total",
            interface="eth0",
            id=sandbox_id,
        )
        for _ in range(3):
            assert ping(ip)
        wait_until(
            lambda: (
                _value(
                    list(_metrics(daemon, sandbox_id).metrics),
                    "container_network_receive_packets_total",
                    interface="eth0",
                )
                >= received + 3
            ),
            timeout=30,
        )


def test_a_stopped_pod_reports_no_metrics(daemon: Daemon, short_tmp: Path) -> None:
    with pod(daemon, "gone", short_tmp) as p:
        daemon.runtime().StopPodSandbox(
            api_pb2.StopPodSandboxRequest(pod_sandbox_id=p[0]), timeout=60
        )
        response = daemon.runtime().ListPodSandboxMetrics(
            api_pb2.ListPodSandboxMetricsRequest(), timeout=10
        )
        assert [m.pod_sandbox_id for m in response.pod_metrics] == []


# cAdvisor's container metrics as kubelet shows them (critest's list), less those that no
# runtime serves yet (hugetlb, pressure, CPU quota, memory reservation, ulimits).
CADVISOR_METRICS = {
    "container_blkio_device_usage_total",
    "container_cpu_cfs_periods_total",
    "container_cpu_cfs_throttled_periods_total",
    "container_cpu_cfs_throttled_seconds_total",
    "container_cpu_system_seconds_total",
    "container_cpu_usage_seconds_total",
    "container_cpu_user_seconds_total",
    "container_file_descriptors",
    "container_fs_inodes_free",
    "container_fs_inodes_total",
    "container_fs_limit_bytes",
    "container_fs_reads_bytes_total",
    "container_fs_reads_total",
    "container_fs_usage_bytes",
    "container_fs_writes_bytes_total",
    "container_fs_writes_total",
    "container_last_seen",
    "container_memory_cache",
    "container_memory_failcnt",
    "container_memory_failures_total",
    "container_memory_kernel_usage",
    "container_memory_mapped_file",
    "container_memory_max_usage_bytes",
    "container_memory_rss",
    "container_memory_swap",
    "container_memory_usage_bytes",
    "container_memory_working_set_bytes",
    "container_oom_events_total",
    "container_processes",
    "container_sockets",
    "container_spec_cpu_period",
    "container_spec_cpu_shares",
    "container_spec_memory_limit_bytes",
    "container_spec_memory_swap_limit_bytes",
    "container_start_time_seconds",
    "container_threads",
    "container_threads_max",
}
# Block I/O is counted only where the writable layer's disk reports per-cgroup I/O.
BLOCK_IO = {
    "container_blkio_device_usage_total",
    "container_fs_reads_bytes_total",
    "container_fs_reads_total",
    "container_fs_writes_bytes_total",
    "container_fs_writes_total",
}


def test_every_cadvisor_metric_is_described_and_served_with_its_labels(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    import_image(daemon, busybox_layout)
    descriptors = _descriptors(daemon)
    assert CADVISOR_METRICS <= set(descriptors)
    assert all(d.help and d.label_keys for d in descriptors.values())
    resources = api_pb2.LinuxContainerResources(
        cpu_period=100000,
        cpu_quota=20000,
        cpu_shares=512,
        memory_limit_in_bytes=64 * MIB,
        memory_swap_limit_in_bytes=64 * MIB,
    )
    with pod(daemon, "cadvisor", short_tmp) as p:
        # A listening socket and a file written to the writable layer.
        script = "echo hi > /written; nc -l -p 8080 & sleep 300"
        linux = api_pb2.LinuxContainerConfig(resources=resources)
        container_id = create(daemon, p, container_config("full", script, linux=linux))
        start(daemon, container_id)

        def served() -> dict[str, list[api_pb2.Metric]]:
            found: dict[str, list[api_pb2.Metric]] = {}
            for metric in _metrics(daemon, p[0]).container_metrics[0].metrics:
                found.setdefault(metric.name, []).append(metric)
            return found

        wait_until(lambda: served().get("container_sockets", [None])[0] is not None, timeout=10)
        wait_until(lambda: served()["container_sockets"][0].value.value >= 1, timeout=10)
        metrics = served()
        assert CADVISOR_METRICS - BLOCK_IO <= set(metrics)
        for name, series in metrics.items():
            for metric in series:
                assert len(metric.label_values) == len(descriptors[name].label_keys), name

        def value(name: str, **labels: str) -> int:
            keys = list(descriptors[name].label_keys)
            for metric in metrics[name]:
                values = dict(zip(keys, metric.label_values, strict=True))
                if all(values[k] == v for k, v in labels.items()):
                    return metric.value.value
            raise AssertionError(f"no {name} with {labels}")

        # The cgroup's settings are the container's resources.
        assert value("container_spec_cpu_period") == 100000
        assert value("container_spec_cpu_shares") == 512
        assert value("container_spec_memory_swap_limit_bytes") == 64 * MIB
        assert value("container_file_descriptors") >= 3
        assert value("container_fs_usage_bytes") > 0
        assert value("container_fs_limit_bytes") > value("container_fs_usage_bytes")
        assert 0 < value("container_fs_inodes_free") < value("container_fs_inodes_total")
        assert value("container_memory_failures_total", failure_type="pgfault") > 0
        assert abs(value("container_last_seen") - time.time()) < 60
