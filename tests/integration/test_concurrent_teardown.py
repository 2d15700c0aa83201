"""Stop and removal are idempotent under concurrency, against the real daemon.

kubelet, an operator's crictl and a controller's retry can ask for the same stop or
removal at the same moment. Both calls must succeed (a removal that waits for another
removal of the same object succeeds with it, as removing an absent object does), the
object's event must be sent once, and nothing may be left behind.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, pod_config, wait_until
from tests.integration.cri_testkit import (
    EventStream,
    container_config,
    create,
    event_stream,
    import_image,
    pod,
    remove,
    remove_pod,
    run_pod,
    start,
    status,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

STOPPED = api_pb2.CONTAINER_STOPPED_EVENT
DELETED = api_pb2.CONTAINER_DELETED_EVENT
STOP, REMOVE = "stop", "remove"
PAIRS = [(STOP, STOP), (REMOVE, REMOVE), (STOP, REMOVE), (REMOVE, STOP)]
ROUNDS = 3


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


def at_once(*calls: Callable[[], object]) -> list[str | None]:
    """Run the calls in threads released together; each one's error (None: it succeeded)."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], object]) -> str | None:
        barrier.wait()
        try:
            call()
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return None

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def container_call(daemon: Daemon, what: str, container_id: str) -> Callable[[], object]:
    runtime = daemon.runtime()
    if what == STOP:
        # sleep, as the container's PID 1, ignores SIGTERM: the stop waits out its grace
        # period, and the other call arrives while it does.
        request = api_pb2.StopContainerRequest(container_id=container_id, timeout=2)
        return lambda: runtime.StopContainer(request, timeout=60)
    removal = api_pb2.RemoveContainerRequest(container_id=container_id)
    return lambda: runtime.RemoveContainer(removal, timeout=60)


def pod_call(daemon: Daemon, what: str, sandbox_id: str) -> Callable[[], object]:
    runtime = daemon.runtime()
    if what == STOP:
        request = api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id)
        return lambda: runtime.StopPodSandbox(request, timeout=60)
    removal = api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)
    return lambda: runtime.RemovePodSandbox(removal, timeout=60)


def events_so_far(daemon: Daemon, stream: EventStream, tag: str) -> Counter[tuple[str, int]]:
    """Every event sent so far, counted by (object ID, kind): a pod run and removed now
    is the marker, since the stream delivers events in the order they were sent."""
    marker = run_pod(daemon, pod_config(f"marker-{tag}", uid=f"uid-marker-{tag}"))
    remove_pod(daemon, marker)
    seen: Counter[tuple[str, int]] = Counter()
    while True:
        got = stream.next(timeout=30).event
        if got.container_id == marker:
            if got.container_event_type == DELETED:
                return seen
            continue
        seen[(got.container_id, got.container_event_type)] += 1


def pods_with_a_container(daemon: Daemon, log_dir: Path, prefix: str) -> list[tuple[str, str]]:
    """ROUNDS pods, each running one container: (pod ID, container ID) of each. The running
    container makes a pod's stop and removal take a while: they stop it first."""
    pods = []
    for index in range(ROUNDS):
        name = f"{prefix}{index}"
        config = pod_config(name, uid=f"uid-{name}", log_directory=str(log_dir / "logs"))
        sandbox_id = run_pod(daemon, config)
        container_id = create(daemon, (sandbox_id, config), container_config("c", "exec sleep 60"))
        start(daemon, container_id)
        pods.append((sandbox_id, container_id))
    return pods


def no_leaks(daemon: Daemon) -> None:
    # A removed container's teardown ends in the background: wait for it, not for a time.
    wait_until(lambda: not daemon.leaks(), timeout=60)


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=["-".join(p) for p in PAIRS])
def test_two_calls_for_one_container_both_succeed_and_send_its_event_once(
    daemon: Daemon, image: None, short_tmp: Path, first: str, second: str
) -> None:
    config = pod_config("twice", uid="uid-twice", log_directory=str(short_tmp / "logs"))
    sandbox_id = run_pod(daemon, config)
    containers = []
    for index in range(ROUNDS):
        container_id = create(
            daemon, (sandbox_id, config), container_config(f"c{index}", "exec sleep 60")
        )
        start(daemon, container_id)
        containers.append(container_id)
    with event_stream(daemon) as stream:
        for container_id in containers:
            errors = at_once(
                container_call(daemon, first, container_id),
                container_call(daemon, second, container_id),
            )
            assert errors == [None, None], (container_id, errors)
        seen = events_so_far(daemon, stream, "c")
    removed = REMOVE in (first, second)
    for container_id in containers:
        assert seen[(container_id, STOPPED)] == 1, seen
        assert seen[(container_id, DELETED)] == (1 if removed else 0), seen
    listed = daemon.runtime().ListContainers(api_pb2.ListContainersRequest(), timeout=10)
    if removed:
        assert list(listed.containers) == []
    else:
        assert {c.state for c in listed.containers} == {api_pb2.CONTAINER_EXITED}
    remove_pod(daemon, sandbox_id)
    no_leaks(daemon)


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=["-".join(p) for p in PAIRS])
def test_two_calls_for_one_pod_both_succeed_and_send_its_events_once(
    daemon: Daemon, image: None, short_tmp: Path, first: str, second: str
) -> None:
    pods = pods_with_a_container(daemon, short_tmp, "p")
    with event_stream(daemon) as stream:
        for sandbox_id, _container_id in pods:
            errors = at_once(
                pod_call(daemon, first, sandbox_id), pod_call(daemon, second, sandbox_id)
            )
            assert errors == [None, None], (sandbox_id, errors)
        seen = events_so_far(daemon, stream, "p")
    removed = REMOVE in (first, second)
    for sandbox_id, container_id in pods:
        if removed:
            # A removal that comes first leaves a stop nothing to do: no stopped event.
            assert seen[(sandbox_id, STOPPED)] <= 1, seen
        else:
            assert seen[(sandbox_id, STOPPED)] == 1, seen
        assert seen[(sandbox_id, DELETED)] == (1 if removed else 0), seen
        assert seen[(container_id, STOPPED)] == 1, seen
        assert seen[(container_id, DELETED)] == (1 if removed else 0), seen
    listed = daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10)
    if removed:
        assert list(listed.items) == []
    else:
        assert {p.state for p in listed.items} == {api_pb2.SANDBOX_NOTREADY}
        for sandbox_id, _container_id in pods:
            remove_pod(daemon, sandbox_id)
    no_leaks(daemon)


def test_a_pod_removal_and_its_containers_removal_at_once_both_succeed(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    pods = pods_with_a_container(daemon, short_tmp, "q")
    with event_stream(daemon) as stream:
        for sandbox_id, container_id in pods:
            errors = at_once(
                pod_call(daemon, REMOVE, sandbox_id),
                container_call(daemon, REMOVE, container_id),
            )
            assert errors == [None, None], (sandbox_id, errors)
        seen = events_so_far(daemon, stream, "q")
    for sandbox_id, container_id in pods:
        assert seen[(sandbox_id, DELETED)] == 1, seen
        assert seen[(container_id, STOPPED)] == 1, seen
        assert seen[(container_id, DELETED)] == 1, seen
    no_leaks(daemon)


# runc, with the signal of a `kill` (not `--all`) held back after runc found the container
# running: the window in which a container that exits meanwhile makes runc answer "unable
# to signal init: os: process already finished", widened from microseconds to seconds.
HELD_KILL = """#!/bin/sh
case " $* " in
  *" --all "*) ;;
  *" kill "*)
    touch "{held}"
    exec strace -f -qq -o /dev/null -e trace=kill -e inject=kill:delay_enter=2000000 \\
      runc "$@";;
esac
exec runc "$@"
"""


@pytest.fixture
def held_kill(make_daemon: Any, short_tmp: Path, busybox_layout: Path) -> tuple[Daemon, Path]:
    """A daemon whose handler `held` is runc with each container's stop signal held back
    two seconds; and the file the handler touches when it holds one."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed: it holds runc's signal back")
    wrapper, held = short_tmp / "held-kill", short_tmp / "kill-held"
    wrapper.write_text(HELD_KILL.format(held=held))
    wrapper.chmod(0o755)
    handlers = {"runc": {"path": "runc"}, "held": {"path": str(wrapper)}}
    daemon: Daemon = make_daemon(settings={"runtime": {"handlers": handlers}})
    daemon.start()
    import_image(daemon, busybox_layout)
    return daemon, held


@pytest.mark.parametrize("ended_by", ["itself", "a removal"])
def test_a_container_that_exits_while_its_stop_signals_it_is_stopped(
    held_kill: tuple[Daemon, Path], short_tmp: Path, ended_by: str
) -> None:
    daemon, held = held_kill
    script = "exec sleep 1" if ended_by == "itself" else "exec sleep 60"
    with pod(daemon, "racing", short_tmp, handler="held") as p:
        container_id = create(daemon, p, container_config("c", script))
        start(daemon, container_id)
        stop = container_call(daemon, STOP, container_id)
        if ended_by == "itself":
            assert at_once(stop) == [None]
            st = status(daemon, container_id)
            assert (st.state, st.exit_code, st.reason) == (api_pb2.CONTAINER_EXITED, 0, "Completed")
            remove(daemon, container_id)
        else:
            removal = container_call(daemon, REMOVE, container_id)

            def remove_while_held() -> None:
                wait_until(held.exists)
                removal()

            # The removal's SIGKILL (to every process) is not held: it ends the container
            # while the stop's runc holds its SIGTERM.
            assert at_once(stop, remove_while_held) == [None, None]
    no_leaks(daemon)
