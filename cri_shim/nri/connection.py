"""One plugin socket at work: the mux and ttrpc codecs driven over an asyncio stream.

A `MuxedConnection` serves the calls that arrive on one logical connection and makes calls
on the other. The runtime serves the Runtime service on RUNTIME_SERVICE_CONN and calls the
plugin on PLUGIN_SERVICE_CONN; a plugin (the one in the tests) does the opposite. Every call
it makes has a deadline, and a connection that closes fails the calls still waiting, so
nothing waits on a plugin for ever.
"""

from __future__ import annotations

import asyncio
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
        self.closed = asyncio.Event()
        self.close_reason = ""

    async def run(self) -> None:
        """Read the socket until it closes or the peer breaks the protocol."""
        reason = "connection closed by the peer"
        try:
            while data := await self._reader.read(READ_CHUNK):
                for frame in self._frames.feed(data):
                    self._on_frame(frame)
        except (mux.MuxError, ttrpc.TtrpcError) as e:
            reason = f"protocol error: {e}"
            log.warning("NRI %s: %s", self.name, reason)
        except (ConnectionError, OSError) as e:
            reason = f"connection lost: {e}"
        finally:
            await self._shut(reason)

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
        task = asyncio.get_running_loop().create_task(self._answer(request))
        self._handling.add(task)
        task.add_done_callback(self._handling.discard)

    async def _answer(self, request: ttrpc.Request) -> None:
        handler = self._handlers.get(f"{request.service}/{request.method}")
        if handler is None:
            reply = ttrpc.encode_response(
                request.stream_id,
                code=Code.UNIMPLEMENTED,
                message=f"{request.service}/{request.method} is not served here",
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

    async def call(
        self, service: str, method: str, request: ProtoMessage, reply: Reply, timeout: float
    ) -> Reply:
        """Make a call and wait for its answer at most `timeout` seconds.

        Raises CallError (the peer's status, or DEADLINE_EXCEEDED) or ConnectionClosed.
        """
        if self.closed.is_set():
            raise ConnectionClosed(f"{self.name}: {self.close_reason}")
        stream_id, data = self._calls.start(
            service, method, request.SerializeToString(), int(timeout * 1e9)
        )
        waiter: asyncio.Future[bytes | CallError] = asyncio.get_running_loop().create_future()
        self._waiting[stream_id] = waiter
        try:
            self._send(self._call_conn, data)
            await self._writer.drain()
            async with asyncio.timeout(timeout):
                result = await waiter
        except TimeoutError:
            raise CallError(
                Code.DEADLINE_EXCEEDED, f"{self.name}: {method} got no answer in {timeout:g}s"
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
        self._writer.close()
        await self._shut(reason)

    async def _shut(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(ConnectionClosed(f"{self.name}: {reason}"))
        self._waiting.clear()
        for task in list(self._handling):
            task.cancel()
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()
