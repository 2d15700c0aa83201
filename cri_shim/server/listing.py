"""The list RPCs and their streaming twins (KEP-5825) answer from one listing.

The module of each unary list RPC yields its items one at a time from a single function
that applies the filter (`list_containers.containers_listed`, ...), which its streaming
twin imports. The unary RPC collects them into one reply and refuses, naming the
streaming twin, a reply that would pass the message limit: otherwise gRPC fails it with
a size error on the client that says nothing of what to do.
The streaming RPC sends each item as it is made, one per message, and waits for the
transport to take it before it makes the next: a slow reader holds at most an HTTP/2
window of items, never the whole list. A reader that reads nothing would hold the stream
(and its place, server/limits.py) for ever, so each message waits at most
`[requests] stream_write_timeout` (`StreamContext`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

import grpc
from google.protobuf.message import Message

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import ResourceExhausted

if TYPE_CHECKING:
    from cri_shim.config import Config

log = logging.getLogger("cri_shim.server")

# What kubelet accepts in one reply (its max receive size), and so what we send at most.
MAX_REPLY_BYTES = 16 << 20
# A repeated message field costs its tag (1 byte) and a length prefix (up to 5) per item.
_ITEM_OVERHEAD = 6

Item = TypeVar("Item", bound=Message)
Items = Iterable[Item] | AsyncIterable[Item]


Filter = (
    api_pb2.ContainerFilter
    | api_pb2.PodSandboxFilter
    | api_pb2.ContainerStatsFilter
    | api_pb2.PodSandboxStatsFilter
)


def selected(f: Filter, object_id: str, labels: Mapping[str, str], state: int = -1) -> bool:
    """Whether an object passes a list call's filter: its ID starts with the filter's,
    its labels hold every pair of the selector, and its `state`, where the filter has
    one, is the filter's."""
    if f.id and not object_id.startswith(f.id):
        return False
    if isinstance(f, api_pb2.ContainerFilter | api_pb2.PodSandboxFilter):
        if f.HasField("state") and f.state.state != state:
            return False
    return all(labels.get(key) == value for key, value in f.label_selector.items())


def reply_limit(config: Config) -> int:
    """The largest reply the daemon sends (the server's max_send_message_length)."""
    return max(MAX_REPLY_BYTES, config.max_message_bytes)


async def each(items: Items[Item]) -> AsyncIterator[Item]:
    """Plain and async iterables alike, one item at a time."""
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def collect(items: Items[Item], rpc: str, stream_rpc: str, limit: int) -> list[Item]:
    """All of `items` for one unary reply, or ResourceExhausted once they pass `limit`."""
    collected: list[Item] = []
    size = 0
    async for item in each(items):
        size += item.ByteSize() + _ITEM_OVERHEAD
        if size > limit:
            raise ResourceExhausted(
                f"{rpc}: the reply would pass the {limit} byte message limit after "
                f"{len(collected)} items; list with {stream_rpc}, which sends one item per "
                "message"
            )
        collected.append(item)
    return collected


async def stream(
    items: Items[Item],
    context: grpc.aio.ServicerContext,
    message: Callable[[Item], Message],
) -> int:
    """Send each of `items` wrapped by `message`, one per message; the count sent."""
    sent = 0
    async for item in each(items):
        # write() returns once the transport has taken the message: flow control holds
        # the listing here while the client does not read.
        await context.write(message(item))
        sent += 1
    return sent


class StreamStalled(asyncio.CancelledError):
    """A streaming call cancelled because its client did not read in time."""


class StreamContext:
    """The context of a server-streaming call (server/limits.py wraps it in this), whose
    write() waits for the client at most `write_timeout` seconds (None: for ever) and
    ends the call quietly once the client has gone."""

    def __init__(
        self, context: grpc.aio.ServicerContext, rpc: str, write_timeout: float | None
    ) -> None:
        self._context = context
        self._rpc = rpc
        self._write_timeout = write_timeout
        self.sent = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._context, name)

    async def write(self, message: Message | bytes) -> None:
        try:
            async with asyncio.timeout(self._write_timeout):
                await self._context.write(message)
        except TimeoutError:
            # The message stays queued in the transport, which sends no status after it:
            # only cancelling the call frees the stream, and the client sees CANCELLED.
            log.info(
                "%s: the client read nothing for %g s ([requests] stream_write_timeout); "
                "the stream is cancelled after %d messages",
                self._rpc,
                self._write_timeout,
                self.sent,
            )
            raise StreamStalled from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A write fails once the call is over: the client cancelled it, went away or
            # let its deadline pass. That is normal and nobody is left to answer: end as
            # gRPC ends a handler whose call is cancelled while it waits.
            log.debug(
                "%s ended after %d messages: the client has gone (%s)",
                self._rpc,
                self.sent,
                type(exc).__name__,
            )
            raise asyncio.CancelledError from exc
        self.sent += 1
