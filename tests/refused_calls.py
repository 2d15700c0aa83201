"""Shared by the integration tests of hostile requests, floods and fuzzing: a pod with the
busybox test image, containers, and the checks that a refused call left nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, pod_config, wait_until
from tests.integration.cri_testkit import IMAGE as IMAGE  # re-exported for the tests
from tests.integration.cri_testkit import container_config as container_config
from tests.integration.cri_testkit import create, start, status


def code_of(call: object) -> tuple[grpc.StatusCode, str]:
    """Run a zero-argument gRPC call; its status code and details (OK, "" on success)."""
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@contextmanager
def running_pod(
    daemon: Daemon, name: str, log_dir: Path, **kwargs: object
) -> Iterator[tuple[str, api_pb2.PodSandboxConfig]]:
    config = pod_config(name, uid=f"uid-{name}", log_directory=str(log_dir), **kwargs)
    sandbox_id = (
        daemon.runtime()
        .RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=60)
        .pod_sandbox_id
    )
    try:
        yield sandbox_id, config
    finally:
        daemon.runtime().RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=120
        )


def create_request(
    pod: tuple[str, api_pb2.PodSandboxConfig], config: api_pb2.ContainerConfig
) -> api_pb2.CreateContainerRequest:
    return api_pb2.CreateContainerRequest(
        pod_sandbox_id=pod[0], config=config, sandbox_config=pod[1]
    )


def run_to_exit(
    daemon: Daemon, pod: tuple[str, api_pb2.PodSandboxConfig], config: api_pb2.ContainerConfig
) -> tuple[str, api_pb2.ContainerStatus]:
    container_id = create(daemon, pod, config)
    start(daemon, container_id)

    def exited() -> api_pb2.ContainerStatus | None:
        current = status(daemon, container_id)
        return current if current.state == api_pb2.CONTAINER_EXITED else None

    return container_id, wait_until(exited, timeout=30)


def mounts_below(path: Path) -> list[str]:
    return [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(str(path))
    ]


def container_traces(daemon: Daemon) -> dict[str, object]:
    """What a container leaves while it exists: rows, names, directories, mounts."""
    found: dict[str, object] = {}
    if rows := daemon.rows("containers"):
        found["rows"] = [r["id"] for r in rows]
    if names := daemon.rows("names", "kind = 'container'"):
        found["names"] = [r["name"] for r in names]
    directory = daemon.root / "containers"
    if directory.exists() and (entries := sorted(p.name for p in directory.iterdir())):
        found["dirs"] = entries
    if mounts := mounts_below(directory):
        found["mounts"] = mounts
    return found
