"""Pod and container stats (ListPodSandboxStats, PodSandboxStats, ListContainerStats)
against the real daemon: CPU rates from successive samples, the pod's network read
inside its namespace, and the writable layer's disk use walked at most once per
`[metrics] layer_usage_max_age`, as kubelet's summary API wants them."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, ping, pod_config, wait_until
from tests.integration.cri_testkit import (
    container_config,
    create,
    exec_sync,
    import_image,
    pod,
    remove,
    start,
    stop,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

BUSY_LOOP = "while :; do :; done"


def pod_stats(daemon: Daemon, sandbox_id: str) -> api_pb2.PodSandboxStats:
    request = api_pb2.ListPodSandboxStatsRequest(
        filter=api_pb2.PodSandboxStatsFilter(id=sandbox_id)
    )
    (stats,) = daemon.runtime().ListPodSandboxStats(request, timeout=10).stats
    return stats


def test_pod_stats_carry_cpu_rates_and_the_pods_network(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    import_image(daemon, busybox_layout)
    with pod(daemon, "rated", short_tmp) as p:
        sandbox_id = p[0]
        container_id = create(daemon, p, container_config("spinner", BUSY_LOOP))
        start(daemon, container_id)
        first = pod_stats(daemon, sandbox_id)
        # the first sample of each has nothing to compare with
        assert not first.linux.cpu.HasField("usage_nano_cores")
        assert not first.linux.containers[0].cpu.HasField("usage_nano_cores")
        time.sleep(1)  # timed on purpose: the rate is measured over this interval
        second = pod_stats(daemon, sandbox_id)
        (container,) = second.linux.containers
        # one busy loop: about a core, less when the node's two CPUs are shared
        assert 100_000_000 < container.cpu.usage_nano_cores.value < 1_300_000_000
        assert 100_000_000 < second.linux.cpu.usage_nano_cores.value < 1_300_000_000
        # whichever call took the previous sample, the rate covers the time since
        time.sleep(0.5)  # timed on purpose, as above
        request = api_pb2.ListContainerStatsRequest(
            filter=api_pb2.ContainerStatsFilter(id=container_id)
        )
        (listed,) = daemon.runtime().ListContainerStats(request, timeout=10).stats
        assert 100_000_000 < listed.cpu.usage_nano_cores.value < 1_300_000_000
        # kubelet dates the root filesystem's figures by the writable layer's timestamp
        assert abs(listed.writable_layer.timestamp / 1e9 - time.time()) < 60

        network = second.linux.network
        assert network.default_interface.name == "eth0"
        assert [i.name for i in network.interfaces] == ["eth0"]  # loopback is not reported
        ip = (
            daemon.runtime()
            .PodSandboxStatus(
                api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=10
            )
            .status.network.ip
        )
        for _ in range(3):
            assert ping(ip)

        def received() -> int:
            response = daemon.runtime().PodSandboxStats(
                api_pb2.PodSandboxStatsRequest(pod_sandbox_id=sandbox_id), timeout=10
            )
            return int(response.stats.linux.network.default_interface.rx_bytes.value)

        # three echo requests of 84 bytes each at least, on top of what came before
        wait_until(lambda: received() >= network.default_interface.rx_bytes.value + 3 * 84)
        assert pod_stats(daemon, sandbox_id).linux.network.default_interface.tx_bytes.value > 0


def test_a_host_network_pod_reports_no_network_of_its_own(daemon: Daemon) -> None:
    options = api_pb2.NamespaceOption(network=api_pb2.NODE)
    linux = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(namespace_options=options)
    )
    config = pod_config("hostnet-stats", uid="hostnet-stats", linux=linux)
    sandbox_id = (
        daemon.runtime()
        .RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=60)
        .pod_sandbox_id
    )
    try:
        assert not pod_stats(daemon, sandbox_id).linux.HasField("network")
    finally:
        daemon.runtime().RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
        )


def layer_figure(daemon: Daemon, container_id: str) -> tuple[int, int]:
    """(bytes used, timestamp) of the container's writable layer, as ListContainerStats
    reports it."""
    request = api_pb2.ListContainerStatsRequest(
        filter=api_pb2.ContainerStatsFilter(id=container_id)
    )
    (stats,) = daemon.runtime().ListContainerStats(request, timeout=10).stats
    return stats.writable_layer.used_bytes.value, stats.writable_layer.timestamp


def test_the_writable_layer_is_walked_again_only_once_its_figure_is_old(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    daemon.settings["metrics"] = {"layer_usage_max_age": "1h"}
    daemon.restart()
    import_image(daemon, busybox_layout)
    with pod(daemon, "layered", short_tmp) as p:
        container_id = create(daemon, p, container_config("writer", "sleep 3600"))
        start(daemon, container_id)
        before, walked_at = layer_figure(daemon, container_id)
        exec_sync(daemon, container_id, ["dd", "if=/dev/zero", "of=/grown", "bs=1M", "count=2"])
        # Within the hour the figure of the last walk is answered, dated by that walk
        # (PodSandboxStats reads the same figure).
        assert layer_figure(daemon, container_id) == (before, walked_at)
        sandbox_stats = pod_stats(daemon, p[0]).linux.containers[0].writable_layer
        assert (sandbox_stats.used_bytes.value, sandbox_stats.timestamp) == (before, walked_at)

        daemon.settings["metrics"] = {"layer_usage_max_age": "200ms"}
        daemon.restart()
        # Once the figure is older than that, the next call walks the layer again.
        wait_until(lambda: layer_figure(daemon, container_id)[0] >= before + (2 << 20))
        assert layer_figure(daemon, container_id)[1] > walked_at

        stop(daemon, container_id)
        remove(daemon, container_id)
        request = api_pb2.ListContainerStatsRequest()
        assert container_id not in [
            s.attributes.id for s in daemon.runtime().ListContainerStats(request).stats
        ]


def test_one_listing_reports_each_pods_own_network(daemon: Daemon, short_tmp: Path) -> None:
    with pod(daemon, "pinged", short_tmp) as pinged, pod(daemon, "quiet", short_tmp) as quiet:
        ip = (
            daemon.runtime()
            .PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pinged[0]), timeout=10)
            .status.network.ip
        )
        payload = 1400
        for _ in range(5):
            subprocess.run(
                ["ping", "-c", "1", "-W", "2", "-s", str(payload), ip],
                capture_output=True,
                check=True,
            )
        # Both namespaces are read by one thread, in turn: each pod gets its own counters.
        listed = daemon.runtime().ListPodSandboxStats(
            api_pb2.ListPodSandboxStatsRequest(), timeout=10
        )
        received = {
            s.attributes.id: s.linux.network.default_interface.rx_bytes.value for s in listed.stats
        }
        assert received[pinged[0]] >= 5 * payload
        assert received[quiet[0]] < 5 * payload
