"""WebSocket connections for the k8s channel protocols, on websockets' sans-I/O core.

The `websockets` library does the protocol (handshake, framing, masking, ping/pong,
closing handshake); we own the socket, because the same HTTP listener also hands
connections to SPDY. On top of a connection:

- `ChannelMux`: the `channel.k8s.io` family. Each binary message starts with a channel
  byte (0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize; for port-forward 2i/2i+1 are the
  data/error channels of the i-th port). `v5.channel.k8s.io` adds channel 255: a message
  `[255, n]` from the client closes its channel n (stdin's end).
- `WebSocketTransport`: a byte pipe of binary messages, for SPDY tunnelled in a WebSocket
  (`SPDY/3.1+portforward.k8s.io`, used by kubectl 1.30 and later for port-forward).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from websockets.exceptions import NegotiationError
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.typing import Subprotocol

from cri_shim.streaming.chunks import ChunkQueue

log = logging.getLogger("cri_shim.streaming.websocket")

CLOSE_CHANNEL = 255
# A tunnelled SPDY frame or a stdin chunk can be large; the library's 1 MiB default
# would close the connection on a big `kubectl cp`.
MAX_MESSAGE = 16 * 1024 * 1024
# Bytes received but not yet consumed, per connection and per channel.
MAX_BUFFERED = 1024 * 1024
CLOSE_TIMEOUT = 2.0


def make_protocol(supported: Sequence[str]) -> ServerProtocol:
    """A server protocol that picks the first subprotocol the *client* listed that we support.

    A client that offers none is let in without one (older clients); one that offers only
    protocols we do not speak gets a 400 naming ours.
    """

    def select(_: ServerProtocol, offered: Sequence[Subprotocol]) -> Subprotocol | None:
        if not offered:
            return None
        for name in offered:
            if name in supported:
                return name
        raise NegotiationError(
            f"none of the subprotocols {', '.join(offered)} is supported; "
            f"this server speaks {', '.join(supported)}"
        )

    return ServerProtocol(
        subprotocols=[Subprotocol(name) for name in supported],
        select_subprotocol=select,
        max_size=MAX_MESSAGE,
    )


class WebSocketConnection:
    """An accepted WebSocket: `recv()` whole messages, `send()` binary ones, `close()`.

    `closed` is set as soon as the connection stops being open (the client closed it, or
    we started closing, or the transport ended): from then on nothing can be sent.
    """

    def __init__(
        self, protocol: ServerProtocol, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._protocol = protocol
        self._reader = reader
        self._writer = writer
        # Messages not yet taken by recv(): reading the socket stops while this is full.
        self._messages = ChunkQueue(MAX_BUFFERED)
        self._fragments: list[bytes] = []
        self._write_lock = asyncio.Lock()
        self._eof_sent = False
        self._done = asyncio.Event()
        self.closed = asyncio.Event()

    @property
    def subprotocol(self) -> str | None:
        return self._protocol.subprotocol

    async def run(self, pending: bytes = b"") -> None:
        """Read until the transport ends (after the closing handshake, normally)."""
        try:
            if pending:
                await self._receive(pending)
            while True:
                data = await self._reader.read(65536)
                await self._receive(data)
                if not data:
                    break
        except (ConnectionError, OSError) as exc:
            log.debug("WebSocket transport ended: %s", exc)
        finally:
            self._finish()
            self._done.set()

    async def _receive(self, data: bytes) -> None:
        if data:
            self._protocol.receive_data(data)
        else:
            self._protocol.receive_eof()
        for frame in self._protocol.events_received():
            if not isinstance(frame, Frame):
                continue  # the handshake request, parsed before we got here
            if frame.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                self._fragments.append(bytes(frame.data))
                if frame.fin:
                    message = b"".join(self._fragments)
                    self._fragments.clear()
                    await self._messages.put(message)
            elif frame.opcode is Opcode.CLOSE:
                self._finish()
        await self._flush()  # pongs, and our half of a closing handshake the client began
        if self._protocol.state is not State.OPEN:
            self._finish()

    async def _flush(self) -> None:
        async with self._write_lock:
            for chunk in self._protocol.data_to_send():
                if self._eof_sent:
                    break
                if chunk:
                    self._writer.write(chunk)
                else:
                    # The protocol asks to close the TCP connection (the server closes first).
                    self._eof_sent = True
                    if self._writer.can_write_eof():
                        self._writer.write_eof()
            await self._writer.drain()

    def _finish(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self._messages.end()

    async def recv(self) -> bytes | None:
        """The next message (text or binary, as bytes), or None once the connection closed."""
        return await self._messages.get()

    async def send(self, data: bytes) -> None:
        if self._protocol.state is not State.OPEN or self._eof_sent:
            raise ConnectionError("WebSocket closed")
        async with self._write_lock:
            self._protocol.send_binary(data)
        await self._flush()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Start the closing handshake and wait (briefly) for the client to finish it."""
        if self._protocol.state is State.OPEN and not self._eof_sent:
            self._protocol.send_close(code, reason)
            with contextlib.suppress(ConnectionError, OSError):
                await self._flush()
        self._finish()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._done.wait(), CLOSE_TIMEOUT)


class WebSocketTransport:
    """Binary messages as a byte stream: SPDY tunnelled through a WebSocket."""

    def __init__(self, connection: WebSocketConnection) -> None:
        self._connection = connection

    async def read(self) -> bytes:
        # kubectl writes each piece of a frame as its own message, some of them empty: an
        # empty message is not the end of the stream, only None (the connection closed) is.
        while (message := await self._connection.recv()) is not None:
            if message:
                return message
        return b""

    async def write(self, data: bytes) -> None:
        await self._connection.send(data)

    async def close(self) -> None:
        await self._connection.close()


class ChannelMux:
    """Demultiplexes the channel byte of incoming messages; writers add it on the way out."""

    def __init__(self, connection: WebSocketConnection, *, close_frames: bool) -> None:
        self._connection = connection
        self._close_frames = close_frames
        self._inboxes: dict[int, ChunkQueue] = {}

    def reader(self, channel: int) -> ChannelReader:
        return ChannelReader(self._inboxes.setdefault(channel, ChunkQueue(MAX_BUFFERED)))

    def writer(self, channel: int) -> ChannelWriter:
        return ChannelWriter(self, channel)

    async def run(self) -> None:
        """Route messages until the connection ends; then every reader sees its end."""
        try:
            while (message := await self._connection.recv()) is not None:
                if not message:
                    continue
                channel, payload = message[0], message[1:]
                if channel == CLOSE_CHANNEL and self._close_frames:
                    if payload and payload[0] in self._inboxes:
                        self._inboxes[payload[0]].end()
                    continue
                inbox = self._inboxes.get(channel)
                if inbox is not None and payload:
                    # A reader that falls behind (stdin the process does not read) holds up
                    # the connection: back-pressure, not an ever-growing queue.
                    await inbox.put(payload)
        finally:
            for inbox in self._inboxes.values():
                inbox.end()

    async def send(self, channel: int, payload: bytes) -> None:
        await self._connection.send(bytes([channel]) + payload)

    async def close_channel(self, channel: int) -> None:
        """Nothing goes on the wire: kubectl's v5 client logs close frames from the server as
        an unknown stream and discards them; the end of the connection ends every channel."""


class ChannelReader:
    def __init__(self, inbox: ChunkQueue) -> None:
        self._inbox = inbox

    async def read(self) -> bytes:
        """The next chunk, or b"" once the channel or the connection ended."""
        return await self._inbox.get() or b""


class ChannelWriter:
    def __init__(self, mux: ChannelMux, channel: int) -> None:
        self._mux = mux
        self._channel = channel
        self._closed = False

    async def write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionError(f"channel {self._channel} is closed")
        if data:
            await self._mux.send(self._channel, data)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._mux.close_channel(self._channel)
