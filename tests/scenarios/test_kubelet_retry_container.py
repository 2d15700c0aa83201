"""kubelet's retry pattern for CreateContainer, with an OCI runtime slower than the deadline.

The pod runs under a runtime handler whose binary is a test wrapper around runc that
sleeps in `create`, or holds it until the test lets it go, and counts its calls
(tests/fixtures/runtime/slow-runc).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
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
    refused_as_reserved,
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
) -> Iterator[tuple[Daemon, str, api_pb2.PodSandboxConfig, Path, Path]]:
    """A daemon with a pod on the slow handler; parametrize it indirectly with a
    `[creation]` table to change the creation settings. `runc create` waits while the
    hold file (beside the delay file) exists."""
    delay, count = short_tmp / "runc-delay", short_tmp / "runc-count"
    creation: dict[str, object] = getattr(request, "param", {})
    daemon = make_daemon(
        settings={
            "runtime": {"handlers": {"slow": {"path": str(SLOW_RUNC)}}},
            "creation": creation,
        },
        env={
            "SLOW_RUNC_DELAY_FILE": str(delay),
            "SLOW_RUNC_HOLD_FILE": str(hold_file(delay)),
            "SLOW_RUNC_COUNT_FILE": str(count),
        },
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
    yield daemon, sandbox_id, config, delay, count
    hold_file(delay).unlink(missing_ok=True)


def hold_file(delay: Path) -> Path:
    return delay.with_name("runc-hold")


@contextlib.contextmanager
def held(delay: Path) -> Iterator[None]:
    """`runc create` waits until the block ends: the runtime step lasts exactly as long as
    the test needs, whatever the machine's speed."""
    hold_file(delay).touch()
    try:
        yield
    finally:
        hold_file(delay).unlink(missing_ok=True)


def waiting_on(daemon: Daemon) -> int:
    """How many duplicate requests wait on the container creations in flight."""
    return sum(c["watchers"] for c in daemon.creations("container")["in_flight"])


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
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with held(delay):
            with pytest.raises(grpc.RpcError) as first:
                create(daemon, sandbox_id, config, timeout=1.5)
            assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert listed(daemon) == []

            retry = pool.submit(create, daemon, sandbox_id, config, 60)
            wait_until(lambda: waiting_on(daemon) == 1, timeout=30)
        # Let go, the creation finishes and the waiting retry is handed the container.
        container_id = retry.result(timeout=90)
    assert daemon.creations("container")["counters"]["handed_off"] == 1
    assert listed(daemon) == [container_id]
    assert creates(count) == 1
    # a third request (the response to the second was lost) gets the same container
    assert create(daemon, sandbox_id, config, timeout=30) == container_id
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
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with held(delay):
            with pytest.raises(grpc.RpcError) as first:
                create(daemon, sandbox_id, config, timeout=1.5)
            assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            second = pool.submit(create, daemon, sandbox_id, config, 60)
            wait_until(lambda: waiting_on(daemon) == 1, timeout=30)
        # Refused once the creation finishes, although its deadline is a minute away.
        with pytest.raises(grpc.RpcError) as refused:
            second.result(timeout=90)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "is reserved for" in refused.value.details()
    assert listed(daemon) == []  # cached, invisible until claimed

    container_id = create(daemon, sandbox_id, config, timeout=30)
    assert listed(daemon) == [container_id]
    assert creates(count) == 1
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}


def test_a_retry_whose_deadline_passes_first_is_told_the_stage_then_the_next_claims(  # type: ignore[no-untyped-def]
    slow_pod,
) -> None:
    daemon, sandbox_id, config, delay, count = slow_pod
    with held(delay):
        with pytest.raises(grpc.RpcError) as first:
            create(daemon, sandbox_id, config, timeout=1.5)
        assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert listed(daemon) == []

        # Its deadline passes while `runc create` is held.
        wait_until(lambda: creates(count) == 1, timeout=30)
        second, _ = refused_as_reserved(lambda: create(daemon, sandbox_id, config, timeout=1.5))
        assert "stage: container runtime creation" in second.details()

    # Let go, the creation finishes in the background into the cache; the next claims it.
    wait_until(lambda: daemon.creations("container")["cached"] == 1, timeout=30)
    container_id = create(daemon, sandbox_id, config, timeout=30)
    assert daemon.creations("container")["counters"]["claimed"] == 1
    assert listed(daemon) == [container_id]
    assert creates(count) == 1
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=30
    )
    state = (
        daemon.runtime()
        .ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id), timeout=10)
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
