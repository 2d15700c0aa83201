"""Container lifecycle events for kubelet's evented PLEG (GetContainerEvents).

The lifecycle emits an event at each transition it makes: a container created (made
visible), started, stopped (an exit noticed through conmon's exit file, or a stop), and
removed; a pod sandbox the same way under its own ID, as containerd and CRI-O report their
infra containers, so that kubelet also learns when a pod is ready or stopped.

Each subscriber (one GetContainerEvents stream) has its own bounded queue. An emitter
never waits for a subscriber: when a queue holds `max_queue` events its oldest is dropped
and the drop is logged, and a subscriber whose queue holds more than `max_backlog_bytes`
of events is dropped itself (its stream ends with RESOURCE_EXHAUSTED naming the key, as
containerd drops a slow event subscriber), so a stuck kubelet never blocks a request and
costs a bounded backlog. kubelet relists when it misses events or its stream ends. At
most `max_subscribers` streams are open at once (`[events]`).

Events are rendered (pod sandbox status and container statuses, as the CRI message wants
them, serialized) once, when they happen, and only while someone is subscribed: every
subscriber queues the same bytes, so a subscriber costs its place in the queue, not a
copy (200 streams each serialized a 2.5 MiB event for itself on the event loop). The
renderer is lifecycle/statuses.py's `EventMessages`; this module knows nothing of protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cri_shim.errors import ResourceExhausted
from cri_shim.host.inotify import DirectoryWatch
from cri_shim.logcontext import object_fields

log = logging.getLogger("cri_shim.events")

# The CRI's ContainerEventType values (api_pb2.CONTAINER_*_EVENT), kept here so that the
# lifecycle does not depend on the generated protobuf module for four integers.
CONTAINER_CREATED = 0
CONTAINER_STARTED = 1
CONTAINER_STOPPED = 2
CONTAINER_DELETED = 3

EVENT_NAMES = {
    CONTAINER_CREATED: "created",
    CONTAINER_STARTED: "started",
    CONTAINER_STOPPED: "stopped",
    CONTAINER_DELETED: "deleted",
}

# Per subscriber. kubelet drains its stream continuously; a thousand events is several
# seconds of heavy churn on a busy node.
DEFAULT_MAX_QUEUE = 1000
# The defaults of `[events] max_subscribers` and `max_backlog_bytes` (config/model.py).
DEFAULT_MAX_SUBSCRIBERS = 16
DEFAULT_MAX_BACKLOG_BYTES = 16 << 20
# A slow subscriber's drops are logged at most this often (with the count since).
DROP_LOG_INTERVAL = 1.0


@dataclass(frozen=True)
class ContainerEvent:
    """One transition. For a pod sandbox's own events `container_id == sandbox_id`."""

    container_id: str
    sandbox_id: str
    kind: int  # CONTAINER_CREATED ... CONTAINER_DELETED
    created_at: int  # nanoseconds since the epoch

    @property
    def kind_name(self) -> str:
        return EVENT_NAMES.get(self.kind, str(self.kind))


Renderer = Callable[[ContainerEvent], Any]


class Subscription:
    """One consumer's bounded queue; iterate it to receive rendered events in order.

    An item counts its length in bytes when it has one (the rendered, serialized event)."""

    def __init__(self, number: int, max_queue: int, max_backlog_bytes: int) -> None:
        self.number = number
        self._queue: deque[Any] = deque()
        self._max = max_queue
        self._max_bytes = max_backlog_bytes
        self._bytes = 0
        self._ready = asyncio.Event()
        self._closed = False
        self.dropped = 0
        self._unlogged_drops = 0
        self._last_drop_log = 0.0
        # Why the subscriber was dropped, and who is told at once (its pending write).
        self.fell_behind: ResourceExhausted | None = None
        self.on_fell_behind: Callable[[], None] | None = None

    def put(self, item: Any) -> None:
        if self.fell_behind is not None:
            return
        size = len(item) if isinstance(item, bytes) else 0
        if self._queue and self._bytes + size > self._max_bytes:  # one event always fits
            self._fall_behind(size)
            return
        if len(self._queue) >= self._max:
            oldest = self._queue.popleft()
            self._bytes -= len(oldest) if isinstance(oldest, bytes) else 0
            self.dropped += 1
            self._unlogged_drops += 1
            now = time.monotonic()
            if now - self._last_drop_log >= DROP_LOG_INTERVAL:
                log.warning(
                    "events subscriber %d is not keeping up: dropped its %d oldest event(s) "
                    "(queue of %d full, %d dropped in total)",
                    self.number,
                    self._unlogged_drops,
                    self._max,
                    self.dropped,
                )
                self._unlogged_drops = 0
                self._last_drop_log = now
        self._queue.append(item)
        self._bytes += size
        self._ready.set()

    def _fall_behind(self, size: int) -> None:
        """Drop this subscriber: what it has not read is thrown away, its stream ends."""
        self.fell_behind = ResourceExhausted(
            f"GetContainerEvents: this subscriber fell behind by more than {self._max_bytes} "
            f"bytes of events ({len(self._queue)} unread, next of {size} bytes), the most "
            "allowed ([events] max_backlog_bytes); subscribe again and list what changed"
        )
        log.warning(
            "events subscriber %d is not keeping up: dropped with %d unread events "
            "(%d bytes; [events] max_backlog_bytes %d)",
            self.number,
            len(self._queue),
            self._bytes,
            self._max_bytes,
        )
        self._queue.clear()
        self._bytes = 0
        self._ready.set()
        if self.on_fell_behind is not None:
            self.on_fell_behind()

    def pending(self) -> int:
        return len(self._queue)

    def pending_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        """End the subscription: what is queued is still delivered, then iteration stops."""
        self._closed = True
        self._ready.set()

    async def get(self) -> Any:
        """The next event; raises StopAsyncIteration once closed and drained, and
        ResourceExhausted once the subscriber fell behind."""
        while not self._queue:
            if self.fell_behind is not None:
                raise self.fell_behind
            if self._closed:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        item = self._queue.popleft()
        self._bytes -= len(item) if isinstance(item, bytes) else 0
        return item

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        return await self.get()


class EventBus:
    """Fans lifecycle events out to the current subscribers. `emit` never raises and
    never blocks: a broken renderer loses the event (logged), not the transition."""

    def __init__(
        self,
        max_queue: int = DEFAULT_MAX_QUEUE,
        render: Renderer | None = None,
        *,
        max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
    ) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.max_queue = max_queue
        self.max_subscribers = max_subscribers
        self.max_backlog_bytes = max_backlog_bytes
        # None delivers the events themselves (tests); the daemon renders CRI messages.
        self.render = render
        self._subscribers: dict[int, Subscription] = {}
        self._numbers = itertools.count(1)
        # Rendering reads statuses, and reading a status can notice another exit and emit
        # again. Emissions made while one is being rendered wait their turn here, so that
        # every subscriber sees events in the order the transitions happened.
        self._pending: deque[ContainerEvent] = deque()
        self._dispatching = False

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[Subscription]:
        """A new subscriber's queue while the block runs; ResourceExhausted when
        `max_subscribers` are subscribed already."""
        if len(self._subscribers) >= self.max_subscribers:
            raise ResourceExhausted(
                f"GetContainerEvents: {len(self._subscribers)} event streams are open, the "
                "most allowed ([events] max_subscribers); close one or retry later"
            )
        subscription = Subscription(next(self._numbers), self.max_queue, self.max_backlog_bytes)
        self._subscribers[subscription.number] = subscription
        log.debug("events subscriber %d joined", subscription.number)
        try:
            yield subscription
        finally:
            del self._subscribers[subscription.number]
            log.debug("events subscriber %d left", subscription.number)

    def close(self) -> None:
        """The daemon is stopping: end every stream now rather than make the server's
        shutdown wait out its grace period for streams that never end by themselves."""
        for subscription in self._subscribers.values():
            subscription.close()

    def emit(self, container_id: str, sandbox_id: str, kind: int) -> None:
        event = ContainerEvent(container_id, sandbox_id, kind, time.time_ns())
        log.debug(
            "event %s %s (pod %s)",
            event.kind_name,
            container_id,
            sandbox_id,
            extra=_event_fields(container_id, sandbox_id),
        )
        if not self._subscribers:
            return  # nobody listens: rendering statuses would be wasted work
        self._pending.append(event)
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self._pending:
                self._deliver(self._pending.popleft())
        finally:
            self._dispatching = False

    def _deliver(self, event: ContainerEvent) -> None:
        try:
            item = self.render(event) if self.render is not None else event
        except Exception:  # a transition must never fail because its event could not render
            log.exception(
                "rendering the %s event of %s failed",
                event.kind_name,
                event.container_id,
                extra=_event_fields(event.container_id, event.sandbox_id),
            )
            return
        if item is None:
            return
        for subscription in list(self._subscribers.values()):
            subscription.put(item)


def _event_fields(container_id: str, sandbox_id: str) -> dict[str, str]:
    # A pod's own events carry its ID in both places.
    fields = object_fields("sandbox", sandbox_id)
    if container_id != sandbox_id:
        fields |= object_fields("container", container_id)
    return fields


class ExitWatcher:
    """Watches conmon's exit directories and reports each name whose exit file appeared
    (a container's ID). A lost-events overflow reports None: the receiver must then look
    at every running container.

    The watches are in place once the constructor returns, so that no exit written after
    it can be missed; `run()` then delivers them until cancelled, and closes the watch.
    """

    def __init__(self, directories: list[Path], on_exit: Callable[[str | None], None]) -> None:
        for directory in directories:
            directory.mkdir(parents=True, exist_ok=True)
        self._watch = DirectoryWatch(directories)
        self._on_exit = on_exit

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(self._watch.fileno(), readable.set)
        try:
            while True:
                await readable.wait()
                readable.clear()
                for event in self._watch.read():
                    self._report(None if event.overflowed else event.name)
        finally:
            loop.remove_reader(self._watch.fileno())
            self._watch.close()

    def _report(self, name: str | None) -> None:
        if name is None:
            log.warning("inotify queue overflowed: checking every running container")
        elif name.startswith("."):
            return  # a temporary file on its way to being renamed into place
        try:
            self._on_exit(name)
        except Exception:  # one bad exit file must not stop the watcher
            log.exception("handling the exit file of %s failed", name)
