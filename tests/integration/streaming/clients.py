"""Clients for the streaming protocols, as kubectl, kubelet and crictl speak them.

- `SpdyClient`: the HTTP upgrade to SPDY/3.1 with `X-Stream-Protocol-Version`, then
  streams named by their `streamType` header (exec/attach) or by `port` and `requestID`
  (port-forward). The session's framing is `cri_shim.streaming.spdy`'s, in client mode;
  the kubectl tests check it against an independent implementation.
- `WsCommand`: a WebSocket speaking the k8s channel protocols (`v5`/`v4.channel.k8s.io`).
- `WsPortForward`: port-forward over `v4.channel.k8s.io` WebSocket channels.
- `tunnelled_spdy`: SPDY inside a WebSocket (`SPDY/3.1+portforward.k8s.io`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import struct
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from cri_shim.streaming.spdy import SpdySession, SpdyStream

V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
V3 = "v3.channel.k8s.io"
V2 = "v2.channel.k8s.io"
V1 = "channel.k8s.io"
PORTFORWARD = "portforward.k8s.io"
TUNNEL = "SPDY/3.1+portforward.k8s.io"
TIMEOUT = 20.0


class UpgradeRefused(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


async def http_request(url: str, *, upgrade: str | None = "SPDY/3.1") -> tuple[int, str]:
    """A plain HTTP request (optionally asking for an upgrade); returns (status, body)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        head = f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        if upgrade:
            head += f"Connection: Upgrade\r\nUpgrade: {upgrade}\r\n"
            head += f"X-Stream-Protocol-Version: {V4}\r\n"
        writer.write((head + "\r\n").encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), TIMEOUT)
    finally:
        writer.close()
    status_line, _, rest = data.decode().partition("\r\n")
    return int(status_line.split()[1]), rest.partition("\r\n\r\n")[2]


class _SocketTransport:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: bytes):
        self._reader, self._writer, self._pending = reader, writer, pending

    async def read(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        return await self._reader.read(65536)

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def close(self) -> None:
        self._writer.close()


class _RawWsTransport:
    """Binary WebSocket messages as a byte stream, framed by websockets' sans-I/O client."""

    def __init__(
        self, protocol: ClientProtocol, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._protocol, self._reader, self._writer = protocol, reader, writer

    async def read(self) -> bytes:
        while True:
            chunks = [
                bytes(frame.data)
                for frame in self._protocol.events_received()
                if frame.opcode in (Opcode.BINARY, Opcode.CONT)
            ]
            await self._flush()
            if any(chunks):
                return b"".join(chunks)
            data = await self._reader.read(65536)
            if not data:
                return b""
            self._protocol.receive_data(data)

    async def write(self, data: bytes) -> None:
        self._protocol.send_binary(data)
        await self._flush()

    async def _flush(self) -> None:
        for chunk in self._protocol.data_to_send():
            if chunk:
                self._writer.write(chunk)
        await self._writer.drain()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._protocol.send_close(1000)
            await self._flush()
        self._writer.close()


@dataclass
class SpdyClient:
    session: SpdySession
    protocol: str
    _reading: asyncio.Task[None]
    _close: Callable[[], Any] | None = None

    @classmethod
    async def connect(
        cls, url: str, protocols: list[str], *, headers: dict[str, str] | None = None
    ) -> SpdyClient:
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        head = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            "Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\nContent-Length: 0\r\n"
        )
        for protocol in protocols:
            head += f"X-Stream-Protocol-Version: {protocol}\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        writer.write((head + "\r\n").encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
        lines = raw.decode().split("\r\n")
        status = int(lines[0].split()[1])
        response_headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(":") for line in lines[1:] if line)
        }
        if status != 101:
            body = await asyncio.wait_for(reader.read(), TIMEOUT)
            writer.close()
            raise UpgradeRefused(status, body.decode())
        session = SpdySession(_SocketTransport(reader, writer, b""), server=False)
        client = cls(
            session,
            response_headers.get("x-stream-protocol-version", ""),
            asyncio.create_task(session.run()),
        )
        return client

    @classmethod
    async def over_websocket(cls, url: str) -> SpdyClient:
        """Port-forward SPDY tunnelled in a WebSocket, as kubectl 1.30+ does.

        "SPDY/3.1+portforward.k8s.io" is not a valid RFC 6455 token, so websockets' client
        refuses to ask for it; the handshake is written by hand and websockets frames the
        messages from then on.
        """
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                "Connection: Upgrade\r\nUpgrade: websocket\r\n"
                f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
                f"Sec-WebSocket-Protocol: {TUNNEL}\r\n\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        if status != 101:
            raise UpgradeRefused(status, head.decode())
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        protocol = ClientProtocol(parse_uri(url.replace("http", "ws", 1)), state=State.OPEN)
        session = SpdySession(_RawWsTransport(protocol, reader, writer), server=False)
        return cls(
            session, headers.get("sec-websocket-protocol", ""), asyncio.create_task(session.run())
        )

    async def open(self, **headers: str) -> SpdyStream:
        return await asyncio.wait_for(self.session.open_stream(dict(headers)), TIMEOUT)

    async def close(self) -> None:
        await self.session.close()
        if self._close is not None:
            with contextlib.suppress(Exception):
                await self._close()
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading


async def read_all(stream: SpdyStream | None) -> bytes:
    if stream is None:
        return b""
    chunks = []
    while chunk := await stream.read():
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class CommandResult:
    stdout: bytes
    stderr: bytes
    error: bytes

    @property
    def status(self) -> dict[str, Any] | None:
        return json.loads(self.error) if self.error else None


@dataclass
class SpdyCommand:
    """The streams of one exec/attach over SPDY; output is collected in the background."""

    client: SpdyClient
    streams: dict[str, SpdyStream]
    output: dict[str, bytearray] = field(default_factory=lambda: defaultdict(bytearray))
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _readers: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def start(
        cls,
        url: str,
        *,
        stdin: bool = False,
        stdout: bool = True,
        stderr: bool = True,
        tty: bool = False,
        protocols: list[str] | None = None,
    ) -> SpdyCommand:
        client = await SpdyClient.connect(url, protocols or [V4, V3, V2, V1])
        streams = {"error": await client.open(streamtype="error")}
        if tty and client.protocol in (V3, V4):
            streams["resize"] = await client.open(streamtype="resize")
        for name, wanted in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
            if wanted:
                streams[name] = await client.open(streamtype=name)
        command = cls(client, streams)
        for name in ("stdout", "stderr", "error"):
            if name in streams:
                command._readers.append(asyncio.create_task(command._collect(name)))
        return command

    async def _collect(self, name: str) -> None:
        while chunk := await self.streams[name].read():
            async with self._changed:
                self.output[name] += chunk
                self._changed.notify_all()

    async def wait_for(self, text: bytes, name: str = "stdout") -> None:
        async def until() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: text in self.output[name])

        await asyncio.wait_for(until(), TIMEOUT)

    async def send(self, data: bytes) -> None:
        await self.streams["stdin"].write(data)

    async def close_stdin(self) -> None:
        await self.streams["stdin"].close()

    async def resize(self, width: int, height: int) -> None:
        await self.streams["resize"].write(json.dumps({"Width": width, "Height": height}).encode())

    async def result(self) -> CommandResult:
        await asyncio.wait_for(asyncio.gather(*self._readers), TIMEOUT)
        return CommandResult(
            bytes(self.output["stdout"]), bytes(self.output["stderr"]), bytes(self.output["error"])
        )

    async def close(self) -> None:
        for reader in self._readers:
            reader.cancel()
        await self.client.close()


async def spdy_exec(url: str, *, stdin: bytes | None = None, **kwargs: Any) -> CommandResult:
    command = await SpdyCommand.start(url, stdin=stdin is not None, **kwargs)
    try:
        if stdin is not None:
            await command.send(stdin)
            await command.close_stdin()
        return await command.result()
    finally:
        await command.close()


@dataclass
class WsCommand:
    """A WebSocket exec/attach in the k8s channel protocol; output collected per channel."""

    ws: ClientConnection
    output: dict[int, bytearray] = field(default_factory=lambda: defaultdict(bytearray))
    closed_channels: set[int] = field(default_factory=set)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, url: str, protocols: list[str] | None = None) -> WsCommand:
        ws = await connect(
            url.replace("http", "ws", 1),
            subprotocols=protocols or [V5, V4],  # type: ignore[arg-type]
            max_size=None,
        )
        command = cls(ws)
        command._reader = asyncio.create_task(command._collect())
        return command

    @property
    def protocol(self) -> str | None:
        return self.ws.subprotocol

    async def _collect(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in self.ws:
                assert isinstance(message, bytes)
                async with self._changed:
                    if message[0] == 255:
                        self.closed_channels.add(message[1])
                    else:
                        self.output[message[0]] += message[1:]
                    self._changed.notify_all()

    async def wait_for(self, text: bytes, channel: int = 1) -> None:
        async def until() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: text in self.output[channel])

        await asyncio.wait_for(until(), TIMEOUT)

    async def send(self, data: bytes) -> None:
        await self.ws.send(b"\x00" + data)

    async def close_stdin(self) -> None:
        await self.ws.send(bytes([255, 0]))

    async def resize(self, width: int, height: int) -> None:
        await self.ws.send(b"\x04" + json.dumps({"Width": width, "Height": height}).encode())

    async def result(self) -> CommandResult:
        assert self._reader is not None
        await asyncio.wait_for(self._reader, TIMEOUT)
        return CommandResult(bytes(self.output[1]), bytes(self.output[2]), bytes(self.output[3]))

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()


@contextlib.asynccontextmanager
async def ws_command(url: str, protocols: list[str] | None = None) -> AsyncIterator[WsCommand]:
    command = await WsCommand.start(url, protocols)
    try:
        yield command
    finally:
        await command.close()


@dataclass
class WsPortForward:
    """`v4.channel.k8s.io` port-forward: channel 2i carries port i's data, 2i+1 its errors."""

    ws: ClientConnection
    ports: list[int]
    data: dict[int, bytearray] = field(default_factory=lambda: defaultdict(bytearray))
    prefixes: dict[int, int] = field(default_factory=dict)
    _reader: asyncio.Task[None] | None = None
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    @classmethod
    async def start(cls, url: str, ports: list[int]) -> WsPortForward:
        ws = await connect(url.replace("http", "ws", 1), subprotocols=[V4], max_size=None)  # type: ignore[list-item]
        forward = cls(ws, ports)
        forward._reader = asyncio.create_task(forward._collect())
        return forward

    async def _collect(self) -> None:
        """Sort the frames by channel. A frame the protocol does not allow (text, or a
        channel's first frame shorter than its port) ends the collection with that error,
        which `wait_for` and `close` raise: the test sees it rather than missing data."""
        try:
            async for message in self.ws:
                assert isinstance(message, bytes), f"a text frame on a v4 stream: {message!r}"
                channel, payload = message[0], message[1:]
                async with self._changed:
                    if channel not in self.prefixes:
                        # The first frame on each channel is the port, little-endian.
                        assert len(payload) >= 2, f"channel {channel} began with {payload!r}"
                        self.prefixes[channel] = struct.unpack("<H", payload[:2])[0]
                        payload = payload[2:]
                    self.data[channel] += payload
                    self._changed.notify_all()
        except ConnectionClosed:
            pass  # the end of the stream, whichever side closed it
        finally:
            async with self._changed:
                self._changed.notify_all()

    async def send(self, index: int, data: bytes) -> None:
        await self.ws.send(bytes([2 * index]) + data)

    async def wait_for(self, channel: int, predicate: Callable[[bytes], bool]) -> bytes:
        """What `channel` holds once `predicate` is true of it; the collection's error,
        or an AssertionError, when the stream ends first."""
        reader = self._reader
        assert reader is not None

        async def until() -> None:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: predicate(bytes(self.data[channel])) or reader.done()
                )

        await asyncio.wait_for(until(), TIMEOUT)
        received = bytes(self.data[channel])
        if not predicate(received):
            reader.result()
            raise AssertionError(f"the stream ended with channel {channel} at {received!r}")
        return received

    async def close(self) -> None:
        """Close the connection; raises what went wrong while collecting, if anything."""
        await self.ws.close()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, TIMEOUT)


async def spdy_forward_once(
    client: SpdyClient, port: int, request_id: int, payload: bytes
) -> tuple[bytes, bytes]:
    """One connection through a SPDY port-forward: send payload, half-close, read to the end.

    Returns what came back on the data stream and on the error stream.
    """
    error = await client.open(streamtype="error", port=str(port), requestid=str(request_id))
    data = await client.open(streamtype="data", port=str(port), requestid=str(request_id))
    if payload:
        await data.write(payload)
    await data.close()
    received, error_text = await asyncio.wait_for(
        asyncio.gather(read_all(data), read_all(error)), TIMEOUT
    )
    return received, error_text
