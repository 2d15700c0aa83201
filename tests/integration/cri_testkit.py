"""Helpers for the CRI integration tests (test_cri_*): pods, containers, event streams.

Everything here talks to the real daemon over gRPC, as kubelet does.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, pod_config, wait_until
from tests.harness import import_image as import_image  # re-exported for the tests

IMAGE = "docker.io/library/busybox:latest"


def run_pod(daemon: Daemon, config: api_pb2.PodSandboxConfig, handler: str = "") -> str:
    return (
        daemon.runtime()
        .RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=config, runtime_handler=handler), timeout=60
        )
        .pod_sandbox_id
    )


def remove_pod(daemon: Daemon, sandbox_id: str) -> None:
    daemon.runtime().StopPodSandbox(
        api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
    )
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
    )


@contextmanager
def pod(
    daemon: Daemon, name: str, log_dir: Path, handler: str = "", **kwargs: Any
) -> Iterator[tuple[str, api_pb2.PodSandboxConfig]]:
    """A running pod, stopped and removed afterwards whatever happens."""
    config = pod_config(name, uid=f"uid-{name}", log_directory=str(log_dir / name), **kwargs)
    sandbox_id = run_pod(daemon, config, handler)
    try:
        yield sandbox_id, config
    finally:
        remove_pod(daemon, sandbox_id)


def container_config(name: str, script: str, **kwargs: Any) -> api_pb2.ContainerConfig:
    return api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name=name),
        image=api_pb2.ImageSpec(image=kwargs.pop("image", IMAGE)),
        command=kwargs.pop("command", ["/bin/sh", "-c"]),
        args=[script],
        log_path=f"{name}.log",
        **kwargs,
    )


def create(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig], config: api_pb2.ContainerConfig
) -> str:
    sandbox_id, sandbox_config = pod
    return (
        daemon.runtime()
        .CreateContainer(
            api_pb2.CreateContainerRequest(
                pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox_config
            ),
            timeout=60,
        )
        .container_id
    )


def start(daemon: Daemon, container_id: str) -> None:
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=30
    )


def stop(daemon: Daemon, container_id: str, timeout: int = 0) -> None:
    daemon.runtime().StopContainer(
        api_pb2.StopContainerRequest(container_id=container_id, timeout=timeout), timeout=60
    )


def remove(daemon: Daemon, container_id: str) -> None:
    daemon.runtime().RemoveContainer(
        api_pb2.RemoveContainerRequest(container_id=container_id), timeout=60
    )


def status(daemon: Daemon, container_id: str, verbose: bool = False) -> api_pb2.ContainerStatus:
    return (
        daemon.runtime()
        .ContainerStatus(
            api_pb2.ContainerStatusRequest(container_id=container_id, verbose=verbose), timeout=10
        )
        .status
    )


def pod_state(daemon: Daemon, sandbox_id: str) -> int:
    request = api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id)
    return int(daemon.runtime().PodSandboxStatus(request, timeout=10).status.state)


def run_to_exit(
    daemon: Daemon,
    pod: tuple[str, api_pb2.PodSandboxConfig],
    config: api_pb2.ContainerConfig,
    timeout: float = 30,
) -> api_pb2.ContainerStatus:
    container_id = create(daemon, pod, config)
    start(daemon, container_id)
    return wait_until(
        lambda: (s := status(daemon, container_id)).state == api_pb2.CONTAINER_EXITED and s,
        timeout=timeout,
    )


def exec_sync(daemon: Daemon, container_id: str, cmd: list[str]) -> api_pb2.ExecSyncResponse:
    return daemon.runtime().ExecSync(
        api_pb2.ExecSyncRequest(container_id=container_id, cmd=cmd, timeout=30), timeout=60
    )


def output(st: api_pb2.ContainerStatus, stream: str = "stdout") -> list[str]:
    """The container's logical output lines on one stream (partial records joined)."""
    from tests.crilog import join_partials, read_records

    messages = join_partials(read_records(Path(st.log_path)))
    return [m.content.decode() for m in messages if m.stream == stream]


@dataclass
class Received:
    event: api_pb2.ContainerEventResponse
    at: float  # time.monotonic() when the test received it


@dataclass
class EventStream:
    """A GetContainerEvents stream read by a thread into a queue, as kubelet reads it."""

    call: Any
    items: queue.Queue[Received] = field(default_factory=queue.Queue)
    error: list[BaseException] = field(default_factory=list)

    def next(self, timeout: float = 10.0) -> Received:
        try:
            return self.items.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no container event within {timeout}s") from None

    def expect(self, container_id: str, kind: int, timeout: float = 10.0) -> Received:
        """The next event for `container_id`, which must be of `kind` (others skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.next(max(0.01, deadline - time.monotonic()))
            if got.event.container_id == container_id:
                name = api_pb2.ContainerEventType.Name
                assert got.event.container_event_type == kind, (
                    f"expected {name(kind)} for {container_id[:12]}, got "
                    f"{name(got.event.container_event_type)}"
                )
                return got

    def drain(self) -> list[Received]:
        out = []
        while True:
            try:
                out.append(self.items.get_nowait())
            except queue.Empty:
                return out


@contextmanager
def event_stream(daemon: Daemon) -> Iterator[EventStream]:
    def joined() -> int:
        text = daemon.log_path.read_text(errors="replace")
        return len(re.findall(r"events: subscriber \d+ connected", text))

    before = joined()
    call = daemon.runtime().GetContainerEvents(api_pb2.GetEventsRequest())
    stream = EventStream(call)

    def read() -> None:
        try:
            for event in call:
                stream.items.put(Received(event, time.monotonic()))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                stream.error.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # The subscription exists once the server has the call; a cheap way to be sure is to
    # wait until the daemon logs it (no event could be lost in between otherwise).
    wait_until(lambda: joined() > before, timeout=10)
    try:
        yield stream
    finally:
        call.cancel()
        reader.join(timeout=10)
