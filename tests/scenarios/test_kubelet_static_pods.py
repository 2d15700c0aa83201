"""A real kubelet runs static pods against the daemon, end to end.

kubelet (`../shared/kubelet/kubelet`, beside the clone; the test is skipped without it)
reads pod manifests that the test writes, pulls the image through the daemon from a real
registry on 127.0.0.1, and runs: a long-running container, two containers sharing an
emptyDir with exec probes, a container that keeps failing under restartPolicy Always, and
a host-network pod. The test then removes a manifest, and restarts kubelet and the daemon
together. kubelet's own view (its read-only port's `GET /pods`) and the runtime's (CRI) are
both checked. The time each phase took is printed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, wait_until
from tests.imagebuild import build_image
from tests.kubelet import (
    KUBELET,
    LOOP,
    POD_LOGS,
    Kubelet,
    cgroup_v2,
    container_id,
    containers_of,
    remove_all_sandboxes,
    running_and_ready,
)
from tests.registry import RegistryServer, start_registry
from tests.waiting import TIME_SCALE

# 1 MiB written and synced to the disk below the pod's emptyDir.
WRITE = "dd if=/dev/zero of=/data/written bs=64k count=16 conv=fsync 2>/dev/null"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(
        not KUBELET.exists(),
        reason=f"no kubelet binary at {KUBELET} (the shared directory beside the clone)",
    ),
]


# ---- the runtime's view -----------------------------------------------------------


def sandboxes_of(daemon: Daemon, pod_name: str) -> list[api_pb2.PodSandbox]:
    items = daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10).items
    return [s for s in items if s.metadata.name == pod_name]


def runtime_containers(
    daemon: Daemon, pod_name: str | None = None, state: int | None = None
) -> list[api_pb2.Container]:
    listed = daemon.runtime().ListContainers(api_pb2.ListContainersRequest(), timeout=10)
    return [
        c
        for c in listed.containers
        if (pod_name is None or c.labels.get("io.kubernetes.pod.name") == pod_name)
        and (state is None or c.state == state)
    ]


def process_cgroup(daemon: Daemon, container: str, controller: str) -> str | None:
    """The cgroup of a running container's process in one hierarchy (the unified one on
    cgroup v2), or None once that process has exited: kubelet may have restarted the
    container since its view was read."""
    status = daemon.runtime().ContainerStatus(
        api_pb2.ContainerStatusRequest(container_id=container, verbose=True), timeout=10
    )
    pid = json.loads(status.info["info"])["pid"]
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controllers == "" and path != "/"):
            return path
    raise AssertionError(f"container {container} (pid {pid}) has no {controller} cgroup")


def memory_limit(cgroup: str) -> int:
    v1 = Path("/sys/fs/cgroup/memory") / cgroup.lstrip("/") / "memory.limit_in_bytes"
    if v1.exists():
        return int(v1.read_text())
    return int((Path("/sys/fs/cgroup") / cgroup.lstrip("/") / "memory.max").read_text())


def containers_in_pod_cgroups(kubelet: Kubelet, daemon: Daemon) -> dict[str, str] | None:
    """Each running container's memory cgroup, by container ID, once each is where its
    pod's QoS class puts it: in a cgroup of its own right below its pod's (under systemd's
    driver the scope `cri-shim-<id>.scope` in the pod's slice), where kubelet's pod limits
    and its node-allocatable bound apply. None while a container kubelet reported has
    exited meanwhile (its view is read again)."""
    pods = kubelet.pods()
    found: dict[str, str] = {}
    for name, qos in (("web", "Guaranteed"), ("shared", "BestEffort"), ("hostnet", "BestEffort")):
        pod = pods[name]
        assert pod["status"]["qosClass"] == qos
        pod_cgroup = kubelet.pod_cgroup(pod)
        assert pod_cgroup in kubelet.pod_cgroups()
        for status in containers_of(pod).values():
            container = container_id(status)
            cgroup = process_cgroup(daemon, container, "memory")
            if cgroup is None:
                return None
            if kubelet.systemd:
                assert cgroup == f"{pod_cgroup}/cri-shim-{container}.scope", cgroup
            else:
                assert cgroup.startswith(f"{pod_cgroup}/"), cgroup
            found[container] = cgroup
    return found


def assert_pod_stats(daemon: Daemon, pod_name: str, writer: str, io: bool) -> None:
    """The runtime's stats of a pod, read from the cgroups of the driver it runs: each
    running container's (ListContainerStats, what `crictl stats` shows) and the pod's
    (ListPodSandboxStats, what kubelet's summary API asks for) have CPU time and memory,
    and its metrics (ListPodSandboxMetrics) the same and, for `writer`, which wrote with
    fsync, the bytes written to the block device. `io`: the bytes written, and each
    container's I/O pressure where the kernel keeps it, are asserted (cgroup v2, where
    writeback is accounted to the writer)."""
    pressure = io and Path("/proc/pressure/io").exists()
    runtime = daemon.runtime()
    (sandbox,) = sandboxes_of(daemon, pod_name)
    running = {c.id for c in runtime_containers(daemon, pod_name, api_pb2.CONTAINER_RUNNING)}
    listed = runtime.ListContainerStats(
        api_pb2.ListContainerStatsRequest(
            filter=api_pb2.ContainerStatsFilter(pod_sandbox_id=sandbox.id)
        ),
        timeout=30,
    ).stats
    pod = runtime.PodSandboxStats(
        api_pb2.PodSandboxStatsRequest(pod_sandbox_id=sandbox.id), timeout=30
    ).stats.linux
    stats = [s for s in listed if s.attributes.id in running]
    assert {s.attributes.id for s in stats} == running
    for figures in (*stats, pod):
        assert figures.cpu.usage_core_nano_seconds.value > 0, figures
        assert figures.memory.working_set_bytes.value > 0, figures
    # I/O pressure is each container's (the pod's figures are its containers' sums).
    for figures in stats:
        if pressure:
            assert figures.io.HasField("psi"), figures
    metrics = next(
        p
        for p in runtime.ListPodSandboxMetrics(
            api_pb2.ListPodSandboxMetricsRequest(), timeout=30
        ).pod_metrics
        if p.pod_sandbox_id == sandbox.id
    )
    by_container = {m.container_id: m.metrics for m in metrics.container_metrics}
    assert running <= set(by_container)
    for container in running:
        values: dict[str, int] = {}
        for metric in by_container[container]:
            values[metric.name] = values.get(metric.name, 0) + metric.value.value
        # Whole seconds (cAdvisor's unit): an idle loop has used less than one.
        assert "container_cpu_usage_seconds_total" in values, values
        assert values["container_memory_working_set_bytes"] > 0, values
        if io and container == writer:
            assert values.get("container_fs_writes_bytes_total", 0) > 0, values


# ---- the scenario -----------------------------------------------------------------


@dataclass
class Timings:
    started: float = field(default_factory=time.monotonic)
    phases: list[tuple[str, float]] = field(default_factory=list)
    _mark: float = field(default_factory=time.monotonic)

    def phase(self, name: str) -> None:
        now = time.monotonic()
        self.phases.append((name, now - self._mark))
        # As it goes: pytest shows what the test printed when it fails, hence the phase
        # it failed after.
        print(f"phase done: {name} ({now - self._mark:.1f} s)", flush=True)
        self._mark = now

    def report(self) -> str:
        lines = [f"  {name:<58} {seconds:6.1f} s" for name, seconds in self.phases]
        lines.append(f"  {'total':<58} {time.monotonic() - self.started:6.1f} s")
        return "kubelet static pods scenario:\n" + "\n".join(lines)


@pytest.fixture
def registry(short_tmp: Path) -> Iterator[RegistryServer]:
    server = start_registry(short_tmp / "registry")
    yield server
    server.stop()


@pytest.fixture
def kubelet(short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Kubelet]:
    # The node's name is in every static pod's name and UID: this run's pods (and their
    # logs under /var/log) are its own, whatever other kubelets on the machine run.
    node = f"kl{os.getpid()}"
    # Stats from the CRI (ListPodSandboxStats), not from cAdvisor; the PLEG as asked.
    gates = ["PodAndContainerStatsFromCRI=true"]
    if request.param == "evented-pleg":
        gates.append("EventedPLEG=true")
    # Manifests read every second and pods synced every two: each step is seen at once.
    kubelet = Kubelet(
        short_tmp,
        "",
        node,
        sync_frequency="2s",
        file_check_frequency="1s",
        extra_args=[f"--feature-gates={','.join(gates)}"],
    )
    yield kubelet
    kubelet.cleanup()
    # Where the run's logs are kept for a reader (the guest lane's, which end with it).
    if keep := os.environ.get("CRI_SHIM_TEST_LOGS"):
        kept = Path(keep) / f"{request.node.name}"
        kept.mkdir(parents=True, exist_ok=True)
        for log in short_tmp.glob("*.log"):
            shutil.copy(log, kept / log.name)


# kubelet relists every second (generic PLEG), or follows GetContainerEvents (evented).
@pytest.mark.parametrize("kubelet", ["generic-pleg", "evented-pleg"], indirect=True)
def test_kubelet_runs_static_pods(
    kubelet: Kubelet,
    registry: RegistryServer,
    make_daemon: Callable[..., Daemon],
) -> None:
    timings = Timings()
    manifest_digest = registry.push("e2e/busybox", build_image(), "v1")
    image = f"{registry.host}/e2e/busybox:v1"
    image_ref = f"{registry.host}/e2e/busybox@{manifest_digest}"
    registry.mark()
    daemon = make_daemon(settings={"images": {"insecure_registries": [registry.host]}})
    daemon.start()
    kubelet.endpoint = f"unix://{daemon.socket}"

    def probe(command: str, **more: int) -> dict[str, Any]:
        # A generous timeout: on a loaded two-core machine an exec may take over a second.
        # Scaled as the waits are: an emulated guest's exec takes several seconds.
        action = {"exec": {"command": ["sh", "-c", command]}}
        return {**action, "periodSeconds": 1, "timeoutSeconds": round(5 * TIME_SCALE), **more}

    data = [{"name": "data", "mountPath": "/data"}]
    # Limits equal to requests: a Guaranteed pod, whose cgroup kubelet puts right under
    # kubepods (the others are BestEffort, under kubepods/besteffort).
    limits = {"cpu": "100m", "memory": "64Mi"}
    kubelet.write_pod(
        "web",
        [
            {
                "name": "main",
                "image": image,
                "command": ["sh", "-c", LOOP],
                "resources": {"limits": limits, "requests": limits},
            }
        ],
    )
    kubelet.write_pod(
        "shared",
        [
            {
                "name": "writer",
                "image": image,
                # Written with fsync, the emptyDir's blocks reach the disk: I/O in stats.
                "command": ["sh", "-c", f"echo hello > /data/greeting; {WRITE}; {LOOP}"],
                "volumeMounts": data,
                "livenessProbe": probe("test -f /data/greeting", failureThreshold=2),
                "readinessProbe": probe("test -f /data/greeting"),
            },
            {
                "name": "reader",
                "image": image,
                "command": ["sh", "-c", LOOP],
                "volumeMounts": data,
                "readinessProbe": probe("grep -q hello /data/greeting"),
            },
        ],
        volumes=[{"name": "data", "emptyDir": {}}],
    )
    kubelet.write_pod(
        "crash",
        [{"name": "fail", "image": image, "command": ["sh", "-c", "exit 1"]}],
        restartPolicy="Always",
    )
    kubelet.write_pod(
        "hostnet",
        [{"name": "main", "image": image, "command": ["sh", "-c", LOOP]}],
        hostNetwork=True,
    )
    # A container whose creation fails until its program appears in the shared emptyDir:
    # kubelet numbers each try after the log files it finds, so a failed creation must
    # leave none (its first successful attempt is then still attempt 0). The maker writes
    # the program once the test has seen a creation fail and says go.
    program = '#!/bin/sh\\ntrap "exit 0" TERM; while true; do sleep 1; done\\n'  # for printf
    kubelet.write_pod(
        "late",
        [
            {
                "name": "maker",
                "image": image,
                "command": [
                    "sh",
                    "-c",
                    "trap 'exit 0' TERM; until [ -e /data/go ]; do sleep 1; done; "
                    f"printf '{program}' > /data/.run; chmod +x /data/.run; "
                    f"mv /data/.run /data/run; {LOOP}",
                ],
                "volumeMounts": data,
            },
            {"name": "runner", "image": image, "command": ["/data/run"], "volumeMounts": data},
        ],
        volumes=[{"name": "data", "emptyDir": {}}],
    )
    timings.phase("registry, daemon and manifests ready")

    kubelet.start()
    timings.phase("kubelet healthy")
    wait_until(
        lambda: all(running_and_ready(kubelet.pods().get(n)) for n in ("web", "shared", "hostnet")),
        timeout=90,
        interval=0.5,
    )
    timings.phase("web, shared and hostnet running and ready (one pull)")

    pods = kubelet.pods()
    # The image as the pod names it, and its repository digest: pulled through the daemon.
    for name in ("web", "shared", "hostnet"):
        for status in containers_of(pods[name]).values():
            assert (status["image"], status["imageID"]) == (image, image_ref), status
    assert registry.manifest_gets(), "kubelet's PullImage did not reach the registry"
    # The runtime agrees: one sandbox and running containers per pod, host network shared.
    for name, count in (("web", 1), ("shared", 2), ("hostnet", 1)):
        pod_name = f"{name}-{kubelet.node}"
        (sandbox,) = sandboxes_of(daemon, pod_name)
        assert sandbox.state == api_pb2.SANDBOX_READY
        running = runtime_containers(daemon, pod_name, api_pb2.CONTAINER_RUNNING)
        assert sorted(c.id for c in running) == sorted(
            container_id(s) for s in containers_of(pods[name]).values()
        )
        assert len(running) == count
    cgroups = wait_until(lambda: containers_in_pod_cgroups(kubelet, daemon), timeout=30)
    # The container's own limit is applied in its cgroup below the pod's.
    (main,) = containers_of(pods["web"]).values()
    assert memory_limit(cgroups[container_id(main)]) == 64 << 20
    (hostnet,) = sandboxes_of(daemon, f"hostnet-{kubelet.node}")
    sandbox_status = daemon.runtime().PodSandboxStatus(
        api_pb2.PodSandboxStatusRequest(pod_sandbox_id=hostnet.id), timeout=10
    )
    assert sandbox_status.status.linux.namespaces.options.network == api_pb2.NODE

    # The emptyDir is shared: the reader removes the file, the writer's liveness probe
    # fails, kubelet restarts the writer, which writes it again.
    (reader,) = [
        c
        for c in runtime_containers(daemon, f"shared-{kubelet.node}")
        if c.metadata.name == "reader"
    ]
    daemon.runtime().ExecSync(
        api_pb2.ExecSyncRequest(container_id=reader.id, cmd=["rm", "/data/greeting"], timeout=10),
        timeout=30,
    )

    def writer_restarted() -> bool:
        pod = kubelet.pods()["shared"]
        return running_and_ready(pod) and containers_of(pod)["writer"]["restartCount"] == 1

    wait_until(writer_restarted, timeout=60, interval=0.5)
    assert containers_of(kubelet.pods()["shared"])["reader"]["restartCount"] == 0
    timings.phase("liveness failure restarted the writer; ready again")

    def creation_failures() -> list[str]:
        log = kubelet.log(tail=None).splitlines()
        return [line for line in log if "CreateContainerError" in line]

    wait_until(creation_failures, timeout=60, interval=0.5)
    data_dir = kubelet.root / "pods" / kubelet.pods()["late"]["metadata"]["uid"] / "volumes"
    (data_dir / "kubernetes.io~empty-dir" / "data" / "go").touch()
    late = wait_until(lambda: running_and_ready(p := kubelet.pods().get("late")) and p, timeout=60)
    assert containers_of(late)["runner"]["restartCount"] == 0
    (runner,) = [
        c for c in runtime_containers(daemon, f"late-{kubelet.node}") if c.metadata.name == "runner"
    ]
    assert runner.metadata.attempt == 0
    logs = [p.name for p in POD_LOGS.glob(f"default_late-{kubelet.node}_*/runner/*")]
    assert logs == ["0.log"], logs
    failed = creation_failures()
    timings.phase(f"late program: created at attempt 0 after failures ({len(failed)} log lines)")

    # A removed manifest: the pod goes from kubelet's view and from the runtime.
    kubelet.remove_pod("web")
    wait_until(lambda: "web" not in kubelet.pods(), timeout=30, interval=0.5)
    timings.phase("removed manifest: pod gone from kubelet")
    web = f"web-{kubelet.node}"
    wait_until(
        lambda: not sandboxes_of(daemon, web) and not runtime_containers(daemon, web),
        timeout=120,
        interval=0.5,
    )
    timings.phase("removed manifest: sandbox and containers gone from the runtime")

    # restartPolicy Always: kubelet restarts the failing container with a growing back-off
    # (10 s, then 20 s: the phases above ran meanwhile).
    def crash_looping() -> dict[str, Any] | None:
        fail = containers_of(kubelet.pods()["crash"]).get("fail")
        waiting = (fail or {}).get("state", {}).get("waiting", {})
        if fail and fail["restartCount"] >= 2 and waiting.get("reason") == "CrashLoopBackOff":
            return fail
        return None

    # kubelet's count is the runtime's attempt number of the last container it made. Its
    # status is read again until the two views meet: kubelet may have made the next
    # attempt (its back-off over) before its status said so.
    def crash_loop_seen_by_both() -> dict[str, Any] | None:
        fail = crash_looping()
        crash = runtime_containers(daemon, f"crash-{kubelet.node}")
        attempts = [c.metadata.attempt for c in crash]
        if fail and attempts and fail == crash_looping() and max(attempts) == fail["restartCount"]:
            return fail
        return None

    fail = wait_until(crash_loop_seen_by_both, timeout=60, interval=0.5)
    assert "back-off" in fail["state"]["waiting"]["message"]
    assert fail["lastState"]["terminated"]["exitCode"] == 1
    timings.phase(f"crash loop seen (restart count {fail['restartCount']})")

    # kubelet and the daemon restarted: the running containers are adopted, not recreated.
    before = {
        (name, c): (container_id(s), s["restartCount"])
        for name in ("shared", "hostnet")
        for c, s in containers_of(kubelet.pods()[name]).items()
    }
    running_before = {c.id for c in runtime_containers(daemon, state=api_pb2.CONTAINER_RUNNING)}
    kubelet.stop()
    daemon.restart()
    kubelet.start()
    wait_until(
        lambda: all(
            running_and_ready(kubelet.pods().get(n)) for n in ("shared", "hostnet", "late")
        ),
        timeout=60,
        interval=0.5,
    )
    timings.phase("kubelet and daemon restarted; pods ready again")
    after = {
        (name, c): (container_id(s), s["restartCount"])
        for name in ("shared", "hostnet")
        for c, s in containers_of(kubelet.pods()[name]).items()
    }
    assert after == before
    running_after = {c.id for c in runtime_containers(daemon, state=api_pb2.CONTAINER_RUNNING)}
    assert {ids for ids, _ in before.values()} <= running_after
    assert running_after <= running_before | {
        c.id for c in runtime_containers(daemon, f"crash-{kubelet.node}")
    }
    # The exited containers were restored too: the crash loop's count goes on from there.
    wait_until(
        lambda: (
            containers_of(kubelet.pods()["crash"]).get("fail", {}).get("restartCount", -1)
            >= fail["restartCount"]
        ),
        timeout=30,
        interval=0.5,
    )

    # kubelet's summary API, from the CRI's pod stats: the pod's network and CPU rates.
    # A rate needs two samples of the object's CPU time, and the daemon restarted: the pod
    # and each of its containers have one once sampled twice since (a container may have
    # been sampled first by a later call than its pod).
    def summary_of(name: str) -> dict[str, Any] | None:
        pods = kubelet.get("/stats/summary").get("pods") or []
        found = [p for p in pods if p["podRef"]["name"] == f"{name}-{kubelet.node}"]
        pod = found[0] if found else None
        rated = [pod.get("cpu", {}), *(c["cpu"] for c in pod.get("containers", []))] if pod else []
        return pod if rated and all("usageNanoCores" in cpu for cpu in rated) else None

    shared = wait_until(lambda: summary_of("shared"), timeout=60, interval=1)
    assert shared["network"]["name"] == "eth0"
    assert shared["network"]["rxBytes"] > 0
    assert {c["name"] for c in shared["containers"]} == {"writer", "reader"}
    timings.phase("summary API: the pod's network and CPU rates")

    (writer,) = [
        c
        for c in runtime_containers(daemon, f"shared-{kubelet.node}", api_pb2.CONTAINER_RUNNING)
        if c.metadata.name == "writer"
    ]
    assert_pod_stats(daemon, f"shared-{kubelet.node}", writer.id, io=cgroup_v2())
    timings.phase("the runtime's stats and metrics: CPU, memory and I/O")

    # Every manifest removed: kubelet stops everything; what its garbage collector has not
    # removed yet is removed through the CRI, and then nothing may be left.
    for name in ("shared", "crash", "hostnet", "late"):
        kubelet.remove_pod(name)
    wait_until(lambda: not kubelet.pods(), timeout=60, interval=0.5)
    wait_until(
        lambda: not runtime_containers(daemon, state=api_pb2.CONTAINER_RUNNING),
        timeout=60,
        interval=0.5,
    )
    timings.phase("all manifests removed: nothing running")
    kubelet.stop()
    kubelet.unmount()
    assert not kubelet.mounts()
    # Nothing runs in kubelet's cgroups any more: each removes.
    assert kubelet.remove_cgroups() == []
    remove_all_sandboxes(daemon.runtime(), timeout=60)
    assert daemon.leaks() == {}, daemon.log()
    timings.phase("kubelet stopped, its root unmounted; nothing leaked")
    # No runtime failure reached kubelet (a probe meeting a stopped container is not one).
    # Another kubelet running on this machine meanwhile removes this run's pod log
    # directories (kubelet's log garbage collection takes every pod it does not know), and
    # a log whose directory is gone cannot be reopened: that failure is forgiven then only.
    gone = "conmon did not reopen" if kubelet.others_seen else None
    errors = [
        line
        for line in kubelet.log(tail=None).splitlines()
        if ("code = Internal" in line or "code = Unknown" in line)
        and "/data/run" not in line
        and (gone is None or gone not in line)
    ]
    assert not errors, "\n".join(errors[:5])
    print(timings.report())
