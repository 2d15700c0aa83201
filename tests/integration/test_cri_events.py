"""GetContainerEvents against the real daemon: kubelet's evented PLEG sees each transition
as it happens, in order, with the pod's status and its containers' statuses."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from tests.harness import Daemon, wait_until
from tests.integration.cri_testkit import (
    container_config,
    create,
    event_stream,
    import_image,
    pod,
    remove,
    start,
    stop,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

CREATED = api_pb2.CONTAINER_CREATED_EVENT
STARTED = api_pb2.CONTAINER_STARTED_EVENT
STOPPED = api_pb2.CONTAINER_STOPPED_EVENT
DELETED = api_pb2.CONTAINER_DELETED_EVENT


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


def test_each_transition_arrives_unasked_and_in_order(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with event_stream(daemon) as events:
        with pod(daemon, "ev", short_tmp) as p:
            sandbox_id = p[0]
            got = events.expect(sandbox_id, CREATED)
            assert got.event.pod_sandbox_status.state == api_pb2.SANDBOX_READY
            assert got.event.pod_sandbox_status.metadata.name == "ev"
            events.expect(sandbox_id, STARTED)

            container_id = create(daemon, p, container_config("short", "sleep 1; exit 7"))
            returned = time.monotonic()
            created = events.expect(container_id, CREATED)
            # Bounds that only say "sent as it happened, not at some later listing".
            assert created.at - returned < 10
            assert [s.id for s in created.event.containers_statuses] == [container_id]
            assert created.event.containers_statuses[0].state == api_pb2.CONTAINER_CREATED

            start(daemon, container_id)
            started_rpc_done = time.monotonic()
            got = events.expect(container_id, STARTED)
            assert got.at - started_rpc_done < 10
            assert got.event.containers_statuses[0].state == api_pb2.CONTAINER_RUNNING

            # Nobody asks for a status from here on: the exit must be noticed by itself
            # (conmon's exit file, through inotify), soon after the process ends.
            stopped = events.expect(container_id, STOPPED, timeout=30)
            (status,) = stopped.event.containers_statuses
            assert status.state == api_pb2.CONTAINER_EXITED and status.exit_code == 7
            lag = time.time_ns() - status.finished_at - int((time.monotonic() - stopped.at) * 1e9)
            assert lag < 10e9, f"stopped event arrived {lag / 1e9:.2f}s after the exit"
            assert stopped.event.created_at >= status.finished_at

            remove(daemon, container_id)
            deleted = events.expect(container_id, DELETED)
            assert list(deleted.event.containers_statuses) == []
            assert deleted.event.pod_sandbox_status.id == sandbox_id

        # The pod's own events under its ID, as kubelet expects of an infra container.
        events.expect(sandbox_id, STOPPED)
        got = events.expect(sandbox_id, DELETED)
        assert got.event.pod_sandbox_status.state == api_pb2.SANDBOX_NOTREADY
        assert not events.error


def test_stop_gives_one_stopped_event_and_every_subscriber_gets_it(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with (
        event_stream(daemon) as first,
        event_stream(daemon) as second,
        pod(daemon, "ev2", short_tmp) as p,
    ):
        container_id = create(daemon, p, container_config("long", "exec sleep 60"))
        start(daemon, container_id)
        # The stop and the exit watcher both see this exit; the event is sent once.
        stop(daemon, container_id, timeout=0)
        remove(daemon, container_id)
        for stream in (first, second):
            kinds = []
            while not kinds or kinds[-1] != DELETED:
                got = stream.next()
                if got.event.container_id == container_id:
                    kinds.append(got.event.container_event_type)
            assert kinds == [CREATED, STARTED, STOPPED, DELETED]
            assert got.event.pod_sandbox_status.metadata.name == "ev2"


def test_a_subscriber_that_never_reads_does_not_slow_the_daemon(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    """A stuck kubelet: a stream nobody reads. Each event carries every container status
    of the pod, so 24 containers make far more than gRPC's flow-control window; the
    daemon's writes to the stuck stream stall, and requests must not notice."""
    count = 24
    stuck = daemon.runtime().GetContainerEvents(api_pb2.GetEventsRequest())
    try:
        with pod(daemon, "ev3", short_tmp) as p:
            timings = []
            ids = []
            for index in range(count):
                began = time.monotonic()
                ids.append(create(daemon, p, container_config(f"c{index:02}", "true")))
                timings.append(time.monotonic() - began)
            for container_id in ids:
                began = time.monotonic()
                remove(daemon, container_id)
                timings.append(time.monotonic() - began)
            # Held by the stuck stream, they would wait for ever (60 s, their deadline).
            assert max(timings) < 10, f"a request took {max(timings):.1f}s"
        # The stream is intact: reading it now yields the events in order.
        kinds = []
        for event in stuck:
            if event.container_id in ids:
                kinds.append((event.container_id, event.container_event_type))
            if len(kinds) == 3 * count:
                break
        # Removing a container that never ran stops it first (created -> exited).
        removed = [(c, kind) for c in ids for kind in (STOPPED, DELETED)]
        assert kinds == [(c, CREATED) for c in ids] + removed
    finally:
        stuck.cancel()


def test_a_stopping_daemon_ends_the_streams_at_once(daemon: Daemon) -> None:
    """kubelet keeps its stream open for ever: a shutdown must not wait for it."""
    # A channel of the stream's own: stop() closes the daemon's, which would end it.
    with grpc.insecure_channel(f"unix://{daemon.socket}") as channel:
        stream = api_pb2_grpc.RuntimeServiceStub(channel).GetContainerEvents(
            api_pb2.GetEventsRequest()
        )
        try:
            wait_until(lambda: "events: subscriber 1 connected" in daemon.log(), timeout=10)
            assert daemon.stop() == 0
            # Ended by the daemon as it stopped, not cut off (UNAVAILABLE) once the
            # server's grace for calls in progress ran out.
            assert list(stream) == []
            assert "events: subscriber 1 disconnected" in daemon.log()
        finally:
            stream.cancel()


def test_subscribers_are_capped_and_one_that_falls_behind_is_dropped(
    make_daemon: type, short_tmp: Path
) -> None:
    """Streams that never read cost a bounded backlog each (the events are serialized once
    and shared): past `[events] max_backlog_bytes` such a stream is dropped and its place
    given back; past `max_subscribers` a new stream is refused by name. A reader that keeps
    up gets every event."""
    daemon: Daemon = make_daemon(
        settings={"events": {"max_subscribers": 4, "max_backlog_bytes": "128KiB"}}
    )
    daemon.start()
    # A client that reads nothing: without BDP probing its window stays at 64 KiB, so
    # the transport holds no more than that of what the daemon sends.
    channel = grpc.insecure_channel(f"unix://{daemon.socket}", [("grpc.http2.bdp_probe", 0)])
    events = api_pb2_grpc.RuntimeServiceStub(channel).GetContainerEvents
    stuck = [events(api_pb2.GetEventsRequest(), timeout=60) for _ in range(3)]
    try:
        wait_until(lambda: logged(daemon, "connected") == 3, timeout=10)
        with event_stream(daemon) as reader:
            refused = daemon.runtime().GetContainerEvents(api_pb2.GetEventsRequest(), timeout=10)
            with pytest.raises(grpc.RpcError) as error:
                next(refused)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "[events] max_subscribers" in (error.value.details() or "")

            # Each of these pods' events carries 50 KiB of annotations: the two a pod's
            # start emits at once fit the backlog, the eight of two pods do not.
            big = {"note": "n" * (50 << 10)}
            for name in ("ev-big1", "ev-big2"):
                with pod(daemon, name, short_tmp, annotations=big) as p:
                    sandbox_id = p[0]
                for kind in (CREATED, STARTED, STOPPED, DELETED):
                    reader.expect(sandbox_id, kind)
            assert not reader.error
            wait_until(lambda: logged(daemon, "is not keeping up: dropped with") == 3)
            wait_until(lambda: logged(daemon, "disconnected") == 3, timeout=10)
        # Their places are free again: four streams at once.
        with (
            event_stream(daemon) as first,
            event_stream(daemon),
            event_stream(daemon),
            event_stream(daemon) as last,
            pod(daemon, "ev-after", short_tmp) as p,
        ):
            first.expect(p[0], CREATED)
            last.expect(p[0], CREATED)
    finally:
        for call in stuck:
            call.cancel()
        channel.close()


def logged(daemon: Daemon, what: str) -> int:
    """How many lines about event subscribers say `what`."""
    lines = daemon.log_path.read_text(errors="replace").splitlines()
    return sum(1 for line in lines if "subscriber" in line and what in line)
