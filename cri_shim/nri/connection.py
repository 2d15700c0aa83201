"""One plugin socket at work: the mux and ttrpc codecs driven over an asyncio stream.

A `MuxedConnection` serves the calls that arrive on one logical connection and makes calls
on the other. The runtime serves the Runtime service on RUNTIME_SERVICE_CONN and calls the
plugin on PLUGIN_SERVICE_CONN; a plugin (the one in the tests) does the opposite. Every call
it makes has one deadline for sending the request and getting the answer, and a connection
that closes fails the calls still waiting, so nothing waits on a plugin for ever.

What a peer can make the runtime hold is bounded: at most MAX_IN_FLIGHT of its requests
are served at once, its socket is not read while more than READ_PAUSE bytes of answers
wait for it (a peer that sends and never reads fills its own socket, not the daemon), and
a peer that lets more than MAX_QUEUED bytes wait for it unread is disconnected.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage

from cri_shim.nri import mux, ttrpc
from cri_shim.nri.ttrpc import CallError, Code

log = logging.getLogger("cri_shim.nri")

# A handler gets the method's request message encoded and returns its response encoded;
# it raises CallError to answer with a status.
Handler = Callable[[bytes], Awaitable[bytes]]
Reply = TypeVar("Reply", bound=ProtoMessage)

READ_CHUNK = 64 * 1024
# Requests of one peer served at once; the rest wait, unread, in the socket.
MAX_IN_FLIGHT = 32
# Bytes written for a peer that it has not read yet: over READ_PAUSE, nothing more is read
# from it until it has; over MAX_QUEUED (room for a few messages of the largest size: a
# split Synchronize, big events in a row), it is disconnected.
READ_PAUSE = 1 << 20
MAX_QUEUED = 16 << 20


class ConnectionClosed(Exception):
    """The plugin connection is gone; calls on it fail with this."""


class MuxedConnection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        serve_conn: int,
        call_conn: int,
        handlers: dict[str, Handler],
        name: str = "plugin",
    ) -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._serve_conn = serve_conn
        self._call_conn = call_conn
        self._handlers = handlers
        self._frames = mux.MuxCodec()
        self._requests = ttrpc.MessageCodec()
        self._responses = ttrpc.MessageCodec()
        self._calls = ttrpc.Calls()
        self._waiting: dict[int, asyncio.Future[bytes | CallError]] = {}
        self._handling: set[asyncio.Task[None]] = set()
        # Requests read beyond MAX_IN_FLIGHT, started as earlier ones are answered; while
        # there are any, the socket is not read.
        self._backlog: collections.deque[ttrpc.Request] = collections.deque()
        self._room = asyncio.Event()
        self._room.set()
        self._abort_reason = ""
        self.closed = asyncio.Event()
        self.close_reason = ""

    async def run(self) -> None:
        """Read the socket until it closes or the peer breaks the protocol."""
        reason = "connection closed by the peer"
        try:
            while data := await self._reader.read(READ_CHUNK):
                for frame in self._frames.feed(data):
                    self._on_frame(frame)
                await self._room.wait()
                if self._writer.transport.get_write_buffer_size() > READ_PAUSE:
                    await self._writer.drain()
        except (mux.MuxError, ttrpc.TtrpcError) as e:
            reason = f"protocol error: {e}"
            log.warning("NRI %s: %s", self.name, reason)
        except (ConnectionError, OSError) as e:
            reason = f"connection lost: {e}"
        finally:
            await self._shut(self._abort_reason or reason)

    def _on_frame(self, frame: mux.Frame) -> None:
        if frame.conn_id == self._serve_conn:
            for event in self._requests.feed(frame.payload):
                self._on_request(event)
        elif frame.conn_id == self._call_conn:
            for event in self._responses.feed(frame.payload):
                answered = self._calls.receive(event)
                if answered is None:
                    continue
                waiter = self._waiting.pop(answered[0], None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(answered[1])
        # frames for any other connection are dropped, as the reference mux does

    def _on_request(self, event: ttrpc.Event) -> None:
        if isinstance(event, ttrpc.Oversized):
            if event.type == ttrpc.MessageType.REQUEST:
                self._send(
                    self._serve_conn,
                    ttrpc.encode_response(
                        event.stream_id,
                        code=Code.RESOURCE_EXHAUSTED,
                        message=f"message of {event.length} bytes exceeds {ttrpc.MAX_MESSAGE}",
                    ),
                )
            return
        if event.type != ttrpc.MessageType.REQUEST:
            return  # ttrpc streams' DATA messages: NRI has none
        request = ttrpc.decode_request(event)
        if len(self._handling) >= MAX_IN_FLIGHT:
            self._backlog.append(request)
            self._room.clear()
        else:
            self._start(request)

    def _start(self, request: ttrpc.Request) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(request))
        self._handling.add(task)
        task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task[None]) -> None:
        self._handling.discard(task)
        if self._backlog and not self.closed.is_set():
            self._start(self._backlog.popleft())
        if not self._backlog:
            self._room.set()

    async def _answer(self, request: ttrpc.Request) -> None:
        handler = self._handlers.get(f"{request.service}/{request.method}")
        if handler is None:
            # Not the peer's own names back: they are up to a message long.
            reply = ttrpc.encode_response(
                request.stream_id, code=Code.UNIMPLEMENTED, message="no such service or method"
            )
        else:
            try:
                reply = ttrpc.encode_response(request.stream_id, await handler(request.payload))
            except CallError as e:
                reply = ttrpc.encode_response(request.stream_id, code=e.code, message=e.message)
            except DecodeError as e:
                reply = ttrpc.encode_response(
                    request.stream_id, code=Code.INVALID_ARGUMENT, message=str(e)
                )
            except Exception as e:
                log.exception("NRI %s: %s/%s failed", self.name, request.service, request.method)
                reply = ttrpc.encode_response(request.stream_id, code=Code.UNKNOWN, message=str(e))
        if not self.closed.is_set():
            self._send(self._serve_conn, reply)

    def _send(self, conn_id: int, data: bytes) -> None:
        self._writer.write(mux.encode(conn_id, data))
        queued = self._writer.transport.get_write_buffer_size()
        if queued > MAX_QUEUED and not self._abort_reason:
            self._abort_reason = f"it reads nothing: {queued} bytes wait for it"
            log.warning("NRI %s: disconnected: %s", self.name, self._abort_reason)
            self._writer.transport.abort()

    async def call(
        self, service: str, method: str, request: ProtoMessage, reply: Reply, timeout: float
    ) -> Reply:
        """Make a call and wait for its answer at most `timeout` seconds.

        The deadline covers the whole call: a peer that does not read its request is as
        late as one that does not answer it. Raises CallError (the peer's status,
        DEADLINE_EXCEEDED, or RESOURCE_EXHAUSTED for a request too big for a message) or
        ConnectionClosed.
        """
        if self.closed.is_set():
            raise ConnectionClosed(f"{self.name}: {self.close_reason}")
        payload = request.SerializeToString()
        try:
            stream_id, data = self._calls.start(service, method, payload, int(timeout * 1e9))
        except ttrpc.TtrpcError as e:  # no stream ID left: the connection is spent
            await self.close(str(e))
            raise ConnectionClosed(f"{self.name}: {e}") from e
        except ttrpc.Oversize:
            raise CallError(
                Code.RESOURCE_EXHAUSTED,
                f"{method} request of {len(payload)} bytes is over the "
                f"{ttrpc.MAX_MESSAGE}-byte limit of a message",
            ) from None
        waiter: asyncio.Future[bytes | CallError] = asyncio.get_running_loop().create_future()
        self._waiting[stream_id] = waiter
        sent = False
        try:
            async with asyncio.timeout(timeout):
                self._send(self._call_conn, data)
                await self._writer.drain()
                sent = True
                result = await waiter
        except TimeoutError:
            what = "got no answer" if sent else "did not read its request"
            raise CallError(
                Code.DEADLINE_EXCEEDED, f"{self.name}: {method} {what} in {timeout:g}s"
            ) from None
        except (ConnectionError, OSError) as e:
            raise ConnectionClosed(f"{self.name}: {e}") from e
        finally:
            self._waiting.pop(stream_id, None)
            self._calls.abandon(stream_id)
        if isinstance(result, CallError):
            raise result
        try:
            reply.ParseFromString(result)
        except DecodeError as e:
            raise CallError(Code.INTERNAL, f"{self.name}: {method} answer: {e}") from e
        return reply

    async def close(self, reason: str = "closed by the runtime") -> None:
        self._hang_up()
        await self._shut(reason)

    def _hang_up(self) -> None:
        # What the peer has not read is thrown away: a graceful close would wait for a
        # peer that reads nothing for ever.
        if self._writer.transport.get_write_buffer_size():
            self._writer.transport.abort()
        else:
            self._writer.close()

    async def _shut(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(ConnectionClosed(f"{self.name}: {reason}"))
        self._waiting.clear()
        self._backlog.clear()
        self._room.set()
        for task in list(self._handling):
            task.cancel()
        self._hang_up()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()
