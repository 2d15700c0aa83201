"""kubelet's retry pattern for CreateContainer, with an OCI runtime slower than the deadline.

The pod runs under a runtime handler whose binary is a test wrapper around runc that
sleeps in `create` and counts its calls (tests/fixtures/runtime/slow-runc).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import (
    BUSYBOX_IMAGE,
    REPO,
    Daemon,
    assert_one_created,
    identical_requests,
    import_image,
    pod_config,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]

SLOW_RUNC = REPO / "tests" / "fixtures" / "runtime" / "slow-runc"


@pytest.fixture
def slow_pod(
    request: pytest.FixtureRequest,
    make_daemon: Callable[..., Daemon],
    short_tmp: Path,
    busybox_layout: Path,
) -> tuple[Daemon, str, api_pb2.PodSandboxConfig, Path, Path]:
    """A daemon with a pod on the slow handler; parametrize it indirectly with a
    `[creation]` table to change the creation settings."""
    delay, count = short_tmp / "runc-delay", short_tmp / "runc-count"
    creation: dict[str, object] = getattr(request, "param", {})
    daemon = make_daemon(
        settings={
            "runtime": {"handlers": {"slow": {"path": str(SLOW_RUNC)}}},
            "creation": creation,
        },
        env={"SLOW_RUNC_DELAY_FILE": str(delay), "SLOW_RUNC_COUNT_FILE": str(count)},
    )
    daemon.start()
    import_image(daemon, busybox_layout)
    config = pod_config("slow-runtime")
    sandbox_id = (
        daemon.runtime()
        .RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=config, runtime_handler="slow"), timeout=30
        )
        .pod_sandbox_id
    )
    return daemon, sandbox_id, config, delay, count


def create(
    daemon: Daemon, sandbox_id: str, config: api_pb2.PodSandboxConfig, timeout: float
) -> str:
    return (
        daemon.runtime()
        .CreateContainer(
            api_pb2.CreateContainerRequest(
                pod_sandbox_id=sandbox_id,
                sandbox_config=config,
                config=api_pb2.ContainerConfig(
                    metadata=api_pb2.ContainerMetadata(name="app"),
                    image=api_pb2.ImageSpec(image=BUSYBOX_IMAGE),
                    command=["sleep", "300"],
                ),
            ),
            timeout=timeout,
        )
        .container_id
    )


def listed(daemon: Daemon) -> list[str]:
    return [
        c.id
        for c in daemon.runtime()
        .ListContainers(api_pb2.ListContainersRequest(), timeout=5)
        .containers
    ]


def creates(count: Path) -> int:
    return len(count.read_text().splitlines()) if count.exists() else 0


def remove_pod(daemon: Daemon, sandbox_id: str) -> None:
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
    )


def test_timeout_then_the_waiting_retry_gets_the_container(slow_pod) -> None:  # type: ignore[no-untyped-def]
    daemon, sandbox_id, config, delay, count = slow_pod
    delay.write_text("3")
    with pytest.raises(grpc.RpcError) as first:
        create(daemon, sandbox_id, config, timeout=1.5)
    assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert listed(daemon) == []

    # The retry waits on the creation and is handed the container when it finishes.
    t0 = time.monotonic()
    container_id = create(daemon, sandbox_id, config, timeout=10)
    waited = time.monotonic() - t0
    assert waited < 6, f"the waiting retry got the container only after {waited:.1f}s"
    assert listed(daemon) == [container_id]
    assert creates(count) == 1
    # a third request (the response to the second was lost) gets the same container
    assert create(daemon, sandbox_id, config, timeout=5) == container_id
    assert creates(count) == 1
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=30
    )
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}


@pytest.mark.parametrize("slow_pod", [{"hand_off": False}], indirect=True)
def test_without_hand_off_the_waiting_retry_is_refused_and_the_next_one_claims(slow_pod) -> None:  # type: ignore[no-untyped-def]
    """CRI-O's answer, kept behind `[creation] hand_off = false` for comparison."""
    daemon, sandbox_id, config, delay, count = slow_pod
    delay.write_text("3")
    with pytest.raises(grpc.RpcError) as first:
        create(daemon, sandbox_id, config, timeout=1.5)
    assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    # Refused once the creation finishes, although its deadline is far off.
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as second:
        create(daemon, sandbox_id, config, timeout=10)
    waited = time.monotonic() - t0
    assert second.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "is reserved for" in second.value.details()
    assert waited < 6, f"the refusal came only after {waited:.1f}s"
    assert listed(daemon) == []  # cached, invisible until claimed

    container_id = create(daemon, sandbox_id, config, timeout=5)
    assert listed(daemon) == [container_id]
    assert creates(count) == 1
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}


def test_a_retry_whose_deadline_passes_first_is_told_the_stage_then_the_next_claims(  # type: ignore[no-untyped-def]
    slow_pod,
) -> None:
    daemon, sandbox_id, config, delay, count = slow_pod
    delay.write_text("4")
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as first:
        create(daemon, sandbox_id, config, timeout=1.5)
    assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert listed(daemon) == []

    # Its deadline (~3s) passes before the creation finishes (~4s): `name is reserved`.
    with pytest.raises(grpc.RpcError) as second:
        create(daemon, sandbox_id, config, timeout=1.5)
    assert second.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "stage: container runtime creation" in second.value.details()

    wait_until(lambda: time.monotonic() - started > 4.5, timeout=10)
    t0 = time.monotonic()
    container_id = create(daemon, sandbox_id, config, timeout=10)
    assert time.monotonic() - t0 < 1.0
    assert listed(daemon) == [container_id]
    assert creates(count) == 1
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=30
    )
    state = (
        daemon.runtime()
        .ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id), timeout=5)
        .status.state
    )
    assert state == api_pb2.CONTAINER_RUNNING
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}


def test_twenty_concurrent_requests_create_one_container(slow_pod) -> None:  # type: ignore[no-untyped-def]
    daemon, sandbox_id, config, delay, count = slow_pod
    delay.write_text("1")
    results = identical_requests(lambda: create(daemon, sandbox_id, config, 30), 20)
    assert_one_created(results)
    # Those that waited on the creation were handed the container too.
    assert all(isinstance(r, str) for r in results), results
    assert creates(count) == 1
    assert len(listed(daemon)) == 1
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}
