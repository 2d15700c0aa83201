"""Admission of CRI calls: validation first, then a bounded number in flight.

A flood must neither crash the daemon nor starve the work already running. Calls are
split by what they cost:
- *work* calls (create, start, stop, remove, exec, pull, ...) do host work: at most
  `[requests] max_in_flight` run at once, and at most `max_queued` more wait for a slot,
  in arrival order, until their own deadline (then DEADLINE_EXCEEDED). A call that finds
  both full is refused at once with RESOURCE_EXHAUSTED, which kubelet retries.
- *read* calls (list, status, stats, version) are answered from memory and the database:
  they never wait behind work calls, and only their number in flight is capped.
- *streaming lists* (StreamContainers, ...) last as long as their client takes to read
  them: a client that opens streams and reads nothing holds them open. They are counted
  apart (`max_streams_in_flight`), so that they can never use up the reads' places, and
  each of their messages waits at most `stream_write_timeout` for the client to read
  (server/listing.py).
- Creations outlive their requests (DESIGN §2: a timed-out RunPodSandbox goes on). A slot
  freed by a timed-out request must not let the next one start yet another creation
  without bound, so a new creation is refused while `max_in_flight` creations are still
  running, attached or not.
- A reply nobody reads must not be kept outside every limit (50 ListPodSandbox replies
  of 8 MiB on one connection: the daemon grew by 1.2 GiB). The replies that gRPC holds
  for their clients are capped overall at `max_reply_bytes_in_flight`, counted at what
  the daemon holds for each (`hold_reply`): the bytes serialized, gRPC core's copy of
  them and the call's own state, from the moment the reply is made until gRPC has let
  the call go (its reply taken by the transport, or the call ended by its deadline or
  its client). A reply beyond the cap is refused with RESOURCE_EXHAUSTED, except the
  only one: a single reply always goes. A unary call's place (above) ends with its
  handler: places bound the work, the cap the memory. (A unix socket's peers cannot be
  told apart, so there is no cap per connection.) Unary calls are served as unary
  (services.py), their reply sent with their status in one batch: served as a stream of
  one message, each call cost the event loop a round more, and the status reads under
  load twice their time.
- The event stream (GetContainerEvents) lives as long as its client: it takes no slot;
  the event bus caps the streams and their backlogs (`[events]`, lifecycle/events.py).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import grpc

from cri_shim.config import RequestsConfig
from cri_shim.errors import DeadlineExceeded, ResourceExhausted
from cri_shim.server.listing import StreamContext
from cri_shim.server.validation import validate_request

if TYPE_CHECKING:
    from cri_shim.server.views import EdgeView

READ_RPCS = frozenset(
    {
        "Version",
        "Status",
        "RuntimeConfig",
        "PodSandboxStatus",
        "ListPodSandbox",
        "ContainerStatus",
        "ListContainers",
        "ContainerStats",
        "ListContainerStats",
        "PodSandboxStats",
        "ListPodSandboxStats",
        "ListImages",
        "ImageStatus",
        "ImageFsInfo",
        "ListMetricDescriptors",
        "ListPodSandboxMetrics",
        # These only hand out a URL of the streaming server, which has its own limits.
        "Exec",
        "Attach",
        "PortForward",
    }
)
# The list RPCs' streaming twins (server/listing.py).
LIST_STREAM_RPCS = frozenset(
    {
        "StreamPodSandboxes",
        "StreamContainers",
        "StreamContainerStats",
        "StreamPodSandboxStats",
        "StreamPodSandboxMetrics",
        "StreamImages",
    }
)
STREAM_RPCS = frozenset({"GetContainerEvents"})
CREATION_RPCS = frozenset({"RunPodSandbox", "CreateContainer"})

# While gRPC sends a unary reply, the daemon holds it twice: the serialized bytes (grpcio
# keeps them until the send completes) and gRPC core's copy of them.
REPLY_COPIES = 2
# What a call whose reply waits for its client holds besides the reply: gRPC core's call
# and grpcio's state and tasks for it (19.7 KiB a call, measured with 2000 Version calls
# on 20 connections whose clients gave them no window to send in).
CALL_BYTES = 20 << 10


class RequestLimiter:
    """The admission state of one daemon; see the module docstring."""

    def __init__(
        self,
        config: RequestsConfig,
        creations_in_flight: Callable[[], int] = lambda: 0,
        replies_let_go: Callable[[int], None] = lambda size: None,
    ) -> None:
        self.config = config
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._creations_in_flight = creations_in_flight
        # Told the bytes of replies gRPC has let go (the heap gives them back, host/heap.py).
        self._replies_let_go = replies_let_go
        self.working = 0
        self.queued = 0
        self.reading = 0
        self.streaming = 0
        self.refused = 0
        self.reply_bytes = 0  # held for replies gRPC has not let go (hold_reply)

    def admit(self, rpc: str, deadline: float | None) -> AbstractAsyncContextManager[None]:
        """Hold a place for the call `rpc` while its handler runs. `deadline` is on the
        event loop's clock (None: the caller set none)."""
        if rpc in READ_RPCS:
            return _Place(self, rpc, "reading", "max_reads_in_flight", "read calls are in flight")
        if rpc in STREAM_RPCS:
            return _NO_PLACE
        if rpc in LIST_STREAM_RPCS:
            streams = "streaming lists are open (read or cancel them)"
            return _Place(self, rpc, "streaming", "max_streams_in_flight", streams)
        return self._work(rpc, deadline)

    def check_replies(self, rpc: str, size: int = 0) -> None:
        """Refuse a call whose reply (of `size` bytes; 0: not made yet) would pass
        `max_reply_bytes_in_flight`. Checked before the handler too, so that a call
        refused anyway does not build its reply first."""
        held, limit = self.reply_bytes, self.config.max_reply_bytes_in_flight
        full = held + size > limit if size else held >= limit
        if held and full:
            self.refused += 1
            raise ResourceExhausted(
                f"{rpc}: replies not yet taken by their clients hold {held} bytes, the most "
                "allowed ([requests] max_reply_bytes_in_flight); retry shortly"
            )

    def hold_reply(self, rpc: str, reply: Any, context: grpc.aio.ServicerContext) -> bytes:
        """The serialized `reply` of a unary call, for gRPC to send as it is, counted in
        `reply_bytes` at what the daemon holds for it until gRPC has let the call go (see
        the module docstring). The message itself is dropped once serialized."""
        data: bytes = reply.SerializeToString()
        del reply  # the caller drops it too; a refusal's traceback keeps this frame
        cost = REPLY_COPIES * len(data) + CALL_BYTES
        try:
            self.check_replies(rpc, cost)
        except ResourceExhausted:
            # The refusal waits for its client as long as a reply would: not with this.
            del data
            raise
        self.reply_bytes += cost
        context.add_done_callback(functools.partial(self._let_go, cost))
        return data

    def _let_go(self, cost: int, context: object) -> None:
        self.reply_bytes -= cost
        self._replies_let_go(cost)

    @asynccontextmanager
    async def _work(self, rpc: str, deadline: float | None) -> AsyncIterator[None]:
        if self._slots.locked() and self.queued >= self.config.max_queued:
            self.refused += 1
            raise ResourceExhausted(
                f"{rpc}: the runtime is busy: {self.working} calls in flight and "
                f"{self.queued} waiting, the most allowed ([requests] max_in_flight, "
                "max_queued); retry shortly"
            )
        self.queued += 1
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise DeadlineExceeded(
                f"{rpc}: the deadline passed while waiting behind {self.working} calls in "
                "flight; nothing was done"
            ) from None
        finally:
            self.queued -= 1
        self.working += 1
        try:
            if rpc in CREATION_RPCS:
                running = self._creations_in_flight()
                if running >= self.config.max_in_flight:
                    self.refused += 1
                    raise ResourceExhausted(
                        f"{rpc}: {running} creations are still running (some for requests "
                        "that timed out), the most allowed ([requests] max_in_flight); "
                        "retry shortly"
                    )
            yield
        finally:
            self.working -= 1
            self._slots.release()


class _Place:
    """A place among at most `[requests] key` calls, counted in `limiter.<counter>`.

    A class rather than an @asynccontextmanager: every read call (Version, the statuses)
    passes here, and the generator costs several times the counting."""

    __slots__ = ("_counter", "_key", "_limiter", "_rpc", "_what")

    def __init__(self, limiter: RequestLimiter, rpc: str, counter: str, key: str, what: str):
        self._limiter = limiter
        self._rpc = rpc
        self._counter = counter
        self._key = key
        self._what = what

    async def __aenter__(self) -> None:
        limiter = self._limiter
        held: int = getattr(limiter, self._counter)
        if held >= getattr(limiter.config, self._key):
            limiter.refused += 1
            raise ResourceExhausted(
                f"{self._rpc}: {held} {self._what}, the most allowed ([requests] "
                f"{self._key}); retry shortly"
            )
        setattr(limiter, self._counter, held + 1)

    async def __aexit__(self, *exc_info: object) -> None:
        setattr(self._limiter, self._counter, getattr(self._limiter, self._counter) - 1)


class _NoPlace:
    async def __aenter__(self) -> None:
        pass

    async def __aexit__(self, *exc_info: object) -> None:
        pass


_NO_PLACE = _NoPlace()


async def admitted(
    handler: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]],
    rpc: str,
    services: EdgeView,
    request: Any,
    context: grpc.aio.ServicerContext,
    deadline: float | None,
    large: bool = False,
) -> Any:
    """Run `handler` for `request` once it is valid and admitted (see the module
    docstring); raises the domain errors the rpc wrapper maps to status codes. `large`:
    the request was too big to parse on the event loop (server/wire.py). `rpc`: the
    method as the CRI names it (server/rpc.py cri_method_name)."""
    if rpc in _VALIDATED_OFF_LOOP or large:
        # Checking a request of many megabytes takes seconds of Python, and
        # CreateContainer's checks stat host paths (a hung NFS mount): neither may hold up
        # the RPCs served beside it.
        await asyncio.to_thread(validate_request, rpc, request)
    else:
        validate_request(rpc, request)
    async with services.limiter.admit(rpc, deadline):
        if rpc in LIST_STREAM_RPCS or rpc in STREAM_RPCS:
            # Streams' writes end quietly when the client goes; a list's have a deadline.
            # The event stream has none: a subscriber that falls behind is dropped instead
            # (lifecycle/events.py).
            timeout = services.config.requests.stream_write_timeout
            context = StreamContext(context, rpc, timeout if rpc in LIST_STREAM_RPCS else None)
            return await handler(services, request, context)
        services.limiter.check_replies(rpc)
        return await handler(services, request, context)


_VALIDATED_OFF_LOOP = frozenset({"CreateContainer"})
