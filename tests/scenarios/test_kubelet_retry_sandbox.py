"""kubelet's retry pattern against the real daemon, with a CNI plugin slower than the deadline.

The slow test plugin is chained after bridge; it sleeps as long as the test says, or holds
the network step until the test lets it go, can be told to fail, and counts its ADDs, so
the tests can prove the work was done exactly once. What the daemon's creations are doing
(who waits on them, what is cached) is read from Status verbose, not guessed from time.
"""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import (
    CniTestNetwork,
    Daemon,
    assert_one_created,
    identical_requests,
    pod_config,
    refused_as_reserved,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]


def run_pod(daemon: Daemon, name: str, timeout: float) -> str:
    return (
        daemon.runtime()
        .RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod_config(name)), timeout=timeout)
        .pod_sandbox_id
    )


def listed(daemon: Daemon) -> list[str]:
    return [
        i.id
        for i in daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=5).items
    ]


def remove_all(daemon: Daemon) -> None:
    for sandbox_id in listed(daemon):
        daemon.runtime().RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
        )


def waiting_on(daemon: Daemon) -> int:
    """How many duplicate requests wait on the sandbox creations in flight."""
    return sum(c["watchers"] for c in daemon.creations("sandbox")["in_flight"])


def assert_ready(daemon: Daemon, sandbox_id: str) -> None:
    status = (
        daemon.runtime()
        .PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=5)
        .status
    )
    assert status.state == api_pb2.SANDBOX_READY
    assert status.network.ip


def assert_claimed_once(daemon: Daemon, network: CniTestNetwork, sandbox_id: str) -> None:
    """The sandbox is ready and listed after one CNI ADD; a repeat of the request (its
    response lost) gets the same sandbox; removed, it leaves nothing."""
    assert_ready(daemon, sandbox_id)
    assert network.adds() == 1
    assert listed(daemon) == [sandbox_id]
    assert run_pod(daemon, "slow", timeout=5) == sandbox_id
    assert network.adds() == 1
    remove_all(daemon)
    assert daemon.leaks() == {}


def test_timeout_then_the_waiting_retry_gets_the_sandbox(
    daemon: Daemon, test_network: CniTestNetwork
) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with test_network.held():
            with pytest.raises(grpc.RpcError) as first:
                run_pod(daemon, "slow", timeout=1.5)
            assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert listed(daemon) == []  # kubelet must see "no sandbox" and retry

            retry = pool.submit(run_pod, daemon, "slow", 60)
            wait_until(lambda: waiting_on(daemon) == 1, timeout=30)
        # Let go, the creation finishes and the waiting retry is handed the sandbox: not
        # at its own deadline (a minute away) and not with `name is reserved`.
        sandbox_id = retry.result(timeout=90)
    assert daemon.creations()["counters"]["handed_off"] == 1
    assert_claimed_once(daemon, test_network, sandbox_id)


def test_without_hand_off_the_waiting_retry_is_refused_and_the_next_one_claims(
    make_daemon,
    test_network: CniTestNetwork,  # type: ignore[no-untyped-def]
) -> None:
    """CRI-O's answer, kept behind `[creation] hand_off = false` for comparison."""
    daemon: Daemon = make_daemon(settings={"creation": {"hand_off": False}})
    daemon.start()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with test_network.held():
            with pytest.raises(grpc.RpcError) as first:
                run_pod(daemon, "slow", timeout=1.5)
            assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            second = pool.submit(run_pod, daemon, "slow", 60)
            wait_until(lambda: waiting_on(daemon) == 1, timeout=30)
        # Refused once the creation finishes, although its deadline is a minute away.
        with pytest.raises(grpc.RpcError) as refused:
            second.result(timeout=90)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "is reserved for" in refused.value.details()
    assert listed(daemon) == []  # cached, invisible until claimed

    sandbox_id = run_pod(daemon, "slow", timeout=30)
    assert_ready(daemon, sandbox_id)
    assert test_network.adds() == 1
    assert listed(daemon) == [sandbox_id]
    remove_all(daemon)
    assert daemon.leaks() == {}


def test_a_retry_whose_deadline_passes_first_is_told_the_stage_then_the_next_claims(
    daemon: Daemon, test_network: CniTestNetwork
) -> None:
    with test_network.held():
        with pytest.raises(grpc.RpcError) as first:
            run_pod(daemon, "slow", timeout=1.5)
        assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert listed(daemon) == []

        # Its deadline passes while the creation is held at the network step.
        wait_until(lambda: test_network.adds() == 1, timeout=30)
        second, _ = refused_as_reserved(lambda: run_pod(daemon, "slow", timeout=1.5))
        assert "is reserved for" in second.details()
        assert "stage: sandbox network" in second.details()
        assert listed(daemon) == []

    # Let go, the creation finishes in the background into the cache; the next claims it.
    wait_until(lambda: daemon.creations()["cached"] == 1, timeout=30)
    sandbox_id = run_pod(daemon, "slow", timeout=30)
    assert daemon.creations()["counters"]["claimed"] == 1
    assert_claimed_once(daemon, test_network, sandbox_id)


def test_twenty_concurrent_requests_create_one_sandbox(
    daemon: Daemon, test_network: CniTestNetwork
) -> None:
    test_network.delay_file.write_text("1")
    results = identical_requests(lambda: run_pod(daemon, "crowd", 30), 20)
    assert_one_created(results)
    # Those that waited on the creation were handed the sandbox too.
    assert all(isinstance(r, str) for r in results), results
    assert test_network.adds() == 1
    assert len(listed(daemon)) == 1
    remove_all(daemon)
    assert daemon.leaks() == {}


def test_failing_plugin_wakes_the_waiter_at_once(
    daemon: Daemon, test_network: CniTestNetwork
) -> None:
    test_network.delay_file.write_text("2")
    test_network.fail_file.write_text("network exploded")
    with pytest.raises(grpc.RpcError):
        run_pod(daemon, "doomed", timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as waiter:
        run_pod(daemon, "doomed", timeout=30)
    waited = time.monotonic() - t0
    assert "network exploded" in waiter.value.details()
    assert waited < 10, f"the waiter was woken only after {waited:.1f}s"
    wait_until(lambda: daemon.leaks() == {}, timeout=20)


def test_unclaimed_sandbox_expires_and_leaves_nothing(
    make_daemon,
    test_network: CniTestNetwork,  # type: ignore[no-untyped-def]
) -> None:
    daemon: Daemon = make_daemon(settings={"creation": {"claim_grace": "1s"}})
    daemon.start()
    test_network.delay_file.write_text("2")
    with pytest.raises(grpc.RpcError):
        run_pod(daemon, "forgotten", timeout=0.5)
    # finished at ~2s, expires 1s later; nobody claims it
    wait_until(lambda: test_network.adds() == 1, timeout=10)
    wait_until(lambda: daemon.leaks() == {}, timeout=20)
    assert listed(daemon) == []
    # the name is free: a new request creates a new sandbox
    test_network.delay_file.write_text("0")
    sandbox_id = run_pod(daemon, "forgotten", timeout=30)
    assert test_network.adds() == 2
    assert listed(daemon) == [sandbox_id]
    remove_all(daemon)
    assert daemon.leaks() == {}


def test_without_keep_on_timeout_the_pod_never_becomes_ready(
    make_daemon,
    test_network: CniTestNetwork,  # type: ignore[no-untyped-def]
) -> None:
    daemon: Daemon = make_daemon(settings={"creation": {"keep_on_timeout": False}})
    daemon.start()
    with test_network.held():
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                run_pod(daemon, "thrown-away", timeout=1.0)
            assert info.value.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.ALREADY_EXISTS,
            )
            # Called off and rolled back, not kept for this retry: kubelet's next one
            # starts from nothing again.
            wait_until(lambda: daemon.leaks() == {}, timeout=30)
    assert listed(daemon) == []
