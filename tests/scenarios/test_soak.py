"""A soak under the real kubelet, with faults: pods added and removed continuously, some
crash-looping, some with exec probes; a CNI plugin that fails one ADD in twenty; the
daemon killed with SIGKILL and restarted every few minutes; one conmon killed (its
container is ended by the daemon, exit code 255, and restarted by kubelet).

kubelet (`../shared/kubelet/kubelet`, its defaults `--cgroups-per-qos=true
--enforce-node-allocatable=pods`, under a cgroup root of the node's own: tests/kubelet.py)
runs static pods that the test writes and removes. At the end, every pod kubelet is given
runs (the crash-looping one is in its back-off), kubelet's containers are the runtime's
running ones, and once all manifests are removed nothing is left: namespaces, mounts, IP
allocations, rows, conmon processes, container state and log files. The daemon's RSS,
sampled at the same age after each restart, does not grow by more than 10 % from the
first restart to the last. The RSS curve is printed.

Five minutes by default; `CRI_SHIM_SOAK=long` runs it for an hour (`CRI_SHIM_SOAK=SECONDS`
for another length).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import CniTestNetwork, Daemon, conmon_of, import_image, wait_until
from tests.kubelet import (
    KUBELET,
    LOOP,
    Kubelet,
    containers_of,
    remove_all_sandboxes,
    running_and_ready,
)

_SOAK = os.environ.get("CRI_SHIM_SOAK", "")
DURATION = 3600.0 if _SOAK == "long" else float(_SOAK) if _SOAK.isdigit() else 300.0
# The daemon is killed this often; the time after the last kill is as long again, so that
# its RSS is compared at the same age after every restart.
KILL_EVERY = 240.0 if DURATION >= 1800 else DURATION / 4
CHURN_LIVE = 10  # churned pods alive at once
CHURN_EVERY = 3.0  # seconds between two churn steps (one pod added, the oldest removed)
FAIL_ONE_ADD_IN = 20  # as the slow plugin says it in its error: "every 20th ADD fails"
RSS_GROWTH = 1.10

pytestmark = [
    pytest.mark.integration,
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.timeout(DURATION + 900),
    pytest.mark.skipif(
        not KUBELET.exists(),
        reason=f"no kubelet binary at {KUBELET} (the shared directory beside the clone)",
    ),
]


def exec_probe(command: str, period: int = 2) -> dict[str, Any]:
    # A generous timeout: on a loaded two-core machine an exec may take over a second.
    return {
        "exec": {"command": ["sh", "-c", command]},
        "periodSeconds": period,
        "timeoutSeconds": 5,
    }


def container(name: str, command: str, **more: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": "docker.io/library/busybox:latest",
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", command],
        **more,
    }


def steady_pods() -> dict[str, list[dict[str, Any]]]:
    """The pods that stay for the whole run."""
    return {
        "keep": [container("main", LOOP)],
        "probed": [
            container(
                "main",
                f"touch /tmp/ok; {LOOP}",
                readinessProbe=exec_probe("test -f /tmp/ok"),
                livenessProbe=exec_probe("true", period=5),
            )
        ],
        "crash": [container("fail", "sleep 1; exit 1")],
    }


def churn_pod(index: int) -> list[dict[str, Any]]:
    """Every third churned pod has an exec readiness probe; every fifth crash-loops."""
    if index % 5 == 4:
        return [container("fail", "sleep 2; exit 3")]
    if index % 3 == 2:
        return [container("main", LOOP, readinessProbe=exec_probe("true"))]
    return [container("main", LOOP)]


@dataclass
class RssCurve:
    """The daemon's RSS every few seconds, with the restart it belongs to."""

    samples: list[tuple[float, int, float]] = field(default_factory=list)
    at_age: dict[int, float] = field(default_factory=dict)  # restart -> RSS at the set age

    def sample(self, started: float, restart: int, pid: int) -> float | None:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                    self.samples.append((time.monotonic() - started, restart, rss))
                    return rss
        except (FileNotFoundError, ProcessLookupError):
            pass
        return None

    def report(self) -> str:
        lines = ["daemon RSS (s since the start, restarts so far, MiB):"]
        for t, restart, rss in self.samples:
            lines.append(f"  {t:7.0f} {restart:3d} {rss:7.1f}  {'#' * int(rss / 2)}")
        lines.append(
            "at the same age after each restart: "
            + ", ".join(f"#{r} {rss:.1f}" for r, rss in sorted(self.at_age.items()))
        )
        return "\n".join(lines)


def conmons_of(daemon: Daemon) -> list[int]:
    """conmon processes working for this daemon (their command lines name its roots)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "conmon":
                continue
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if str(daemon.base) in cmdline:
            found.append(int(entry.name))
    return found


def runtime_running(daemon: Daemon) -> dict[str, str]:
    """The runtime's running containers: ID -> its pod's name."""
    listed = daemon.runtime().ListContainers(api_pb2.ListContainersRequest(), timeout=30)
    return {
        c.id: c.labels.get("io.kubernetes.pod.name", "")
        for c in listed.containers
        if c.state == api_pb2.CONTAINER_RUNNING
    }


def retrying(call: Callable[[], Any]) -> Any:
    """A CRI call made while the daemon may be restarting."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture
def node(
    short_tmp: Path,
    test_network: CniTestNetwork,
    make_daemon: Callable[..., Daemon],
    busybox_layout: Path,
) -> Iterator[tuple[Daemon, Kubelet]]:
    # The slow plugin fails one ADD in twenty (it counts the ADDs it is given).
    conflist = test_network.config_dir / "10-test.conflist"
    config = json.loads(conflist.read_text())
    config["plugins"][-1]["failEveryFile"] = str(test_network.control_dir / "fail-every")
    conflist.write_text(json.dumps(config))
    daemon = make_daemon(settings={"log_level": "info"})
    daemon.start()
    import_image(daemon, busybox_layout)
    kubelet = Kubelet(short_tmp / "node", f"unix://{daemon.socket}", f"soak{os.getpid()}")
    try:
        yield daemon, kubelet
    finally:
        # Whatever happened: kubelet stopped, the pods gone, kubelet's root unmounted, its
        # cgroups and logs removed (the fixtures then stop the daemon, remove the network
        # and unmount what is left under the test's directory).
        kubelet.stop()
        try:
            if daemon.proc is None or daemon.proc.poll() is not None:
                daemon.start()
            remove_all_sandboxes(daemon.runtime())
        finally:
            kubelet.cleanup()


def test_soak_with_faults(node: tuple[Daemon, Kubelet], test_network: CniTestNetwork) -> None:
    daemon, kubelet = node
    test_network.control_dir.joinpath("fail-every").write_text(str(FAIL_ONE_ADD_IN))
    for name, containers in steady_pods().items():
        kubelet.write_pod(name, containers, restartPolicy="Always")
    kubelet.start()
    started = time.monotonic()
    curve = RssCurve()
    churned: list[str] = []
    counter = itertools.count()
    restarts = 0
    planned = round(DURATION / KILL_EVERY) - 1
    restarted_at = started
    conmon_killed: tuple[str, int] | None = None
    next_sample = started
    # Until the last restart has run as long as the others ran before their kill.
    while restarts < planned or restarts not in curve.at_age:
        index = next(counter)
        name = f"churn{index}"
        kubelet.write_pod(name, churn_pod(index), restartPolicy="Always")
        churned.append(name)
        if len(churned) > CHURN_LIVE:
            kubelet.remove_pod(churned.pop(0))
        now = time.monotonic()
        assert daemon.proc is not None
        if now >= next_sample:
            curve.sample(started, restarts, daemon.proc.pid)
            next_sample = now + 10
        if now - restarted_at >= KILL_EVERY - 5 and restarts > 0 and restarts not in curve.at_age:
            # The same age after every restart: just before the next kill, or the end.
            rss = curve.sample(started, restarts, daemon.proc.pid)
            assert rss is not None
            curve.at_age[restarts] = rss
        if now - restarted_at >= KILL_EVERY and restarts < planned:
            daemon.kill9()
            daemon.start()
            restarts += 1
            restarted_at = time.monotonic()
        if conmon_killed is None and restarts >= 1 and now - restarted_at >= KILL_EVERY / 2:
            # One conmon killed: the long-running pod's, found through the daemon's state.
            pod = kubelet.pods().get("keep")
            if running_and_ready(pod):
                assert pod is not None
                cid = containers_of(pod)["main"]["containerID"].partition("://")[2]
                pid = conmon_of(daemon, cid)
                os.kill(pid, signal.SIGKILL)
                conmon_killed = (cid, pid)
        time.sleep(CHURN_EVERY)
    print(curve.report())
    print(
        f"{next(counter)} churned pods, {restarts} daemon restarts, conmon killed: {conmon_killed}"
    )
    print(f"CNI ADDs {test_network.adds()}, every {FAIL_ONE_ADD_IN}th failed")
    assert restarts >= 3, "the daemon was not restarted often enough to compare its RSS"
    assert conmon_killed is not None, "no conmon was killed: the test did not test that"
    assert test_network.adds() >= FAIL_ONE_ADD_IN, "no CNI ADD failed: too few pods"
    assert "every 20th ADD fails" in kubelet.log(tail=None), "kubelet never met a CNI failure"

    # Every pod kubelet is given runs: ready, or (the crash-looping ones) in their back-off
    # after restarts; and the runtime runs exactly kubelet's containers.
    desired = kubelet.manifest_names()

    def settled() -> dict[str, dict[str, Any]] | None:
        pods = kubelet.pods()
        for name in desired:
            pod = pods.get(name)
            if pod is None:
                return None
            fail = containers_of(pod).get("fail")
            if fail is not None:
                if fail["restartCount"] < 1:
                    return None
            elif not running_and_ready(pod):
                return None
        return pods

    pods = wait_until(settled, timeout=240, interval=1)
    assert sorted(pods) == desired
    keep = containers_of(pods["keep"])["main"]
    print(
        f"after its conmon was killed, the container of `keep` is "
        f"{keep['containerID'].partition('://')[2][:12]}, restarted {keep['restartCount']} times"
    )
    # The daemon ended the container whose monitor died (exit 255), and kubelet started
    # it again: the one running now is another.
    assert keep["containerID"].partition("://")[2] != conmon_killed[0], keep
    assert keep["restartCount"] >= 1, keep
    # The crash-looping containers are left out: one that kubelet saw running may have
    # exited by the time the runtime is asked (it runs for a moment at each restart).
    kubelet_running = {
        s["containerID"].partition("://")[2]
        for pod in pods.values()
        for name, s in containers_of(pod).items()
        if "running" in s["state"] and name != "fail"
    }
    in_runtime = retrying(lambda: runtime_running(daemon))
    assert kubelet_running <= set(in_runtime)

    def unknown_to_kubelet() -> dict[str, str]:
        # A crash-looping container may have been started since kubelet was asked.
        known = {
            s["containerID"].partition("://")[2]
            for pod in kubelet.pods().values()
            for s in containers_of(pod).values()
        }
        return {cid: pod for cid, pod in runtime_running(daemon).items() if cid not in known}

    extra = unknown_to_kubelet()
    if extra:
        time.sleep(15)  # kubelet's next sync records what it has just started
        extra = unknown_to_kubelet()
    assert not extra, f"running in the runtime, unknown to kubelet: {extra}"

    # The RSS after the last restart within 10 % of the first's, at the same age.
    first, last = curve.at_age[1], curve.at_age[max(curve.at_age)]
    assert last <= first * RSS_GROWTH, curve.report()

    # All removed: nothing left of any pod.
    for name in desired:
        kubelet.remove_pod(name)
    wait_until(lambda: not kubelet.pods(), timeout=120, interval=1)
    wait_until(lambda: not runtime_running(daemon), timeout=120, interval=1)
    # kubelet removes the pods' log directories in its garbage collection (every minute).
    wait_until(lambda: not kubelet.pod_logs(), timeout=150, interval=2)
    kubelet.stop()
    remove_all_sandboxes(daemon.runtime())
    assert kubelet.cleanup() == []
    assert daemon.leaks() == {}, daemon.log()
    assert conmons_of(daemon) == []
    state = [
        p
        for base in (daemon.root, daemon.run_root)
        for p in base.rglob("containers/*")
        if p.is_dir()
    ]
    assert state == [], state
