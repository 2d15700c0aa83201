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


def _pod_cgroup(name: str, memory_limit: int) -> list[Path]:
    """A pod cgroup as kubelet makes one under the cgroupfs driver (in each hierarchy,
    with the pod's memory limit), for a pod whose cgroup_parent names it."""
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        made = [root / name]
        made[0].mkdir()
        (made[0] / "memory.max").write_text(str(memory_limit))
    else:
        made = [hierarchy / name for hierarchy in root.iterdir() if hierarchy.is_dir()]
        for directory in made:
            directory.mkdir()
        (root / "memory" / name / "memory.limit_in_bytes").write_text(str(memory_limit))
    return made


def test_pod_stats_carry_the_pods_own_memory_limit_and_processes(
    make_daemon: type, busybox_layout: Path, short_tmp: Path
) -> None:
    """kubelet's summary API (PodAndContainerStatsFromCRI) takes a pod's memory and
    process count from ListPodSandboxStats and a container's available memory from its
    stats: the pod's own cgroup (its cgroup_parent) holds its containers and its limit."""
    daemon = make_daemon(settings={"cgroup_manager": "cgroupfs"})
    daemon.start()
    import_image(daemon, busybox_layout)
    pod_limit, container_limit = 256 << 20, 64 << 20
    name = f"cri-shim-test-pod-{short_tmp.name}"
    made = _pod_cgroup(name, pod_limit)
    try:
        linux = api_pb2.LinuxPodSandboxConfig(cgroup_parent=f"/{name}")
        with pod(daemon, "limited", short_tmp, linux=linux) as p:
            resources = api_pb2.LinuxContainerResources(memory_limit_in_bytes=container_limit)
            container_id = create(
                daemon,
                p,
                container_config(
                    "sleeper",
                    "sleep 300 & sleep 300",
                    linux=api_pb2.LinuxContainerConfig(resources=resources),
                ),
            )
            start(daemon, container_id)
            stats = pod_stats(daemon, p[0])
            memory = stats.linux.memory
            assert memory.usage_bytes.value > 0
            assert memory.rss_bytes.value > 0
            assert memory.page_faults.value > 0
            assert memory.HasField("major_page_faults")
            assert memory.working_set_bytes.value > 0
            # read together: what the pod may still use is its limit minus its working set
            assert memory.available_bytes.value + memory.working_set_bytes.value == pod_limit
            # two sleeps (the shell became the second)
            assert stats.linux.process.process_count.value == 2
            (container,) = stats.linux.containers
            figures = container.memory
            assert figures.available_bytes.value + figures.working_set_bytes.value == (
                container_limit
            )
            request = api_pb2.ContainerStatsRequest(container_id=container_id)
            alone = daemon.runtime().ContainerStats(request, timeout=10).stats.memory
            assert 0 < alone.available_bytes.value < container_limit
    finally:
        for directory in made:
            directory.rmdir()


def test_a_pod_without_a_parent_of_its_own_reports_its_containers_working_set(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    """Without a cgroup_parent, pods' containers share one directory: no pod figure of
    the pod's own is read, its working set is its containers' and no limit is claimed."""
    import_image(daemon, busybox_layout)
    with pod(daemon, "parentless", short_tmp) as p:
        container_id = create(daemon, p, container_config("sleeper", "sleep 300"))
        start(daemon, container_id)
        stats = pod_stats(daemon, p[0])
        (container,) = stats.linux.containers
        assert stats.linux.memory.working_set_bytes.value == (
            container.memory.working_set_bytes.value
        )
        assert not stats.linux.memory.HasField("available_bytes")
        assert not stats.linux.HasField("process")
        assert not container.memory.HasField("available_bytes")  # no limit of its own
