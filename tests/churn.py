"""A kubelet-like churn driver: short-lived pods created and removed continuously.

Shared by the churn scenario tests and benchmarks/churn.py. Every call is retried with
the same metadata while the daemon is unavailable (as kubelet does across a runtime
restart). The driver watches, at every moment, that no two live pods share an IP or a
name: an IP is recorded when its pod is ready and forgotten only after RemovePodSandbox
returned, so a double booking by the runtime is caught.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, pod_config

T = TypeVar("T")
IMAGE = "docker.io/library/busybox:latest"
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.CANCELLED,
)


@dataclass
class ChurnReport:
    pods: int = 0
    seconds: float = 0.0
    pod_to_running: list[float] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    peak_rss_mib: float = 0.0

    @property
    def pods_per_second(self) -> float:
        return self.pods / self.seconds if self.seconds else 0.0


class Churn:
    def __init__(
        self, daemon: Daemon, *, lifetime: float = 2.0, call_timeout: float = 60.0
    ) -> None:
        self.daemon = daemon
        self.lifetime = lifetime
        self.call_timeout = call_timeout
        self._lock = threading.Lock()
        self._live_ips: dict[str, str] = {}
        self._live_names: set[str] = set()
        self.report = ChurnReport()
        self.completed = 0

    def _retry(self, what: str, call: Callable[[], T], budget: float = 120.0) -> T:
        deadline = time.monotonic() + budget
        while True:
            try:
                return call()
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: {exc.code().name}: {exc.details()}") from exc
                time.sleep(0.2)

    def one_pod(self, index: int) -> None:
        name = f"churn-{index}"
        config = pod_config(name, uid=f"uid-{index}")
        rt = lambda: self.daemon.runtime()  # noqa: E731 - the channel changes across restarts
        started = time.monotonic()
        sandbox_id = self._retry(
            "RunPodSandbox",
            lambda: (
                rt()
                .RunPodSandbox(
                    api_pb2.RunPodSandboxRequest(config=config), timeout=self.call_timeout
                )
                .pod_sandbox_id
            ),
        )
        ip = self._retry(
            "PodSandboxStatus",
            lambda: (
                rt()
                .PodSandboxStatus(
                    api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=10
                )
                .status.network.ip
            ),
        )
        with self._lock:
            if ip in self._live_ips:
                self.report.conflicts.append(f"IP {ip} of {name} also held by {self._live_ips[ip]}")
            if name in self._live_names:
                self.report.conflicts.append(f"name {name} live twice")
            self._live_ips[ip] = name
            self._live_names.add(name)
        container_config = api_pb2.ContainerConfig(
            metadata=api_pb2.ContainerMetadata(name="main"),
            image=api_pb2.ImageSpec(image=IMAGE),
            command=["sleep", str(self.lifetime)],
        )
        container_id = self._retry(
            "CreateContainer",
            lambda: (
                rt()
                .CreateContainer(
                    api_pb2.CreateContainerRequest(
                        pod_sandbox_id=sandbox_id, config=container_config, sandbox_config=config
                    ),
                    timeout=self.call_timeout,
                )
                .container_id
            ),
        )
        self._retry("StartContainer", lambda: self._start(container_id))
        with self._lock:
            self.report.pod_to_running.append(time.monotonic() - started)
        deadline = time.monotonic() + self.lifetime + 30
        while time.monotonic() < deadline:
            try:
                state = (
                    rt()
                    .ContainerStatus(
                        api_pb2.ContainerStatusRequest(container_id=container_id), timeout=10
                    )
                    .status.state
                )
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                state = None
            if state == api_pb2.CONTAINER_EXITED:
                break
            time.sleep(0.25)
        self._retry(
            "StopPodSandbox",
            lambda: rt().StopPodSandbox(
                api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=self.call_timeout
            ),
        )
        self._retry(
            "RemovePodSandbox",
            lambda: rt().RemovePodSandbox(
                api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                timeout=self.call_timeout,
            ),
        )
        with self._lock:
            self._live_ips.pop(ip, None)
            self._live_names.discard(name)
            self.completed += 1

    def _start(self, container_id: str) -> None:
        try:
            self.daemon.runtime().StartContainer(
                api_pb2.StartContainerRequest(container_id=container_id), timeout=self.call_timeout
            )
        except grpc.RpcError as exc:
            # A retry after a lost response finds it started already.
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "running" in exc.details():
                return
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "exited" in exc.details():
                return
            raise

    def run(
        self, pods: int, parallel: int, during: Callable[[Churn], Any] | None = None
    ) -> ChurnReport:
        started = time.monotonic()
        stop_sampling = threading.Event()
        sampler = threading.Thread(target=self._sample_rss, args=(stop_sampling,), daemon=True)
        sampler.start()
        side = threading.Thread(target=during, args=(self,), daemon=True) if during else None
        if side:
            side.start()
        with ThreadPoolExecutor(parallel) as pool:
            futures = [pool.submit(self.one_pod, i) for i in range(pods)]
            for future in futures:
                try:
                    future.result()
                except Exception as exc:  # reported, not raised: the test asserts on it
                    self.report.errors.append(str(exc))
        if side:
            side.join(120)
        stop_sampling.set()
        sampler.join(5)
        self.report.pods = pods
        self.report.seconds = time.monotonic() - started
        return self.report

    def _sample_rss(self, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            proc = self.daemon.proc
            if proc is None:
                continue
            try:
                for line in open(f"/proc/{proc.pid}/status"):
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) / 1024
                        self.report.peak_rss_mib = max(self.report.peak_rss_mib, rss)
            except OSError:
                continue


def restart_midway(at: int, kill: bool = True) -> Callable[[Churn], None]:
    """A side task for Churn.run: kill -9 (or stop) the daemon once `at` pods completed."""

    def side(churn: Churn) -> None:
        while churn.completed < at:
            time.sleep(0.1)
        if kill:
            churn.daemon.kill9()
        else:
            churn.daemon.stop()
        churn.daemon.start()

    return side
