"""SPDY/3.1 framing and sessions, as kubectl, kubelet and crictl speak it for streaming.

No maintained Python library speaks SPDY any more, and the subset Kubernetes needs is
small: control frames (SYN_STREAM, SYN_REPLY, RST_STREAM, SETTINGS, PING, GOAWAY,
HEADERS, WINDOW_UPDATE), data frames with FIN, and zlib-compressed header blocks that
share one compression context per direction, primed with the dictionary of the SPDY/3
specification. `FrameCodec` is the byte-level part (no I/O); `SpdySession` runs it over
any `ByteTransport` (a TCP connection after an HTTP upgrade, or binary WebSocket messages
when kubectl tunnels SPDY through a WebSocket).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import struct
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("cri_shim.streaming.spdy")

SPDY_VERSION = 3
INITIAL_WINDOW = 64 * 1024
# Data frames we send are cut to this size so that one busy stream does not hold the
# connection (and the others' output) for long.
MAX_DATA_CHUNK = 16 * 1024
# A header block larger than this once inflated is refused: a zip bomb guard.
MAX_HEADER_BLOCK = 256 * 1024
# A peer that ignores flow control (Go's spdystream does) can queue unbounded data on a
# stream nobody reads; past this we stop reading the connection until the reader catches up.
MAX_BUFFERED_PER_STREAM = 16 * 1024 * 1024
# A session as a whole: a peer spreading data over many streams that nobody reads must not
# add up past this. Reading the transport pauses until readers catch up.
MAX_BUFFERED_PER_SESSION = 32 * 1024 * 1024
# Streams the peer may hold open at once: exec and attach need five, port-forward two per
# connection it forwards. More are refused with RST_STREAM(REFUSED_STREAM).
MAX_PEER_STREAMS = 256


def _spdy3_dictionary() -> bytes:
    """The zlib dictionary of SPDY/3 (draft-mbelshe-httpbis-spdy-00, section 2.6.10.1).

    It is the words below, each preceded by its length as a 32-bit big-endian number,
    followed by a run of status lines, dates and content types written without lengths.
    """
    words = (
        "options head post put delete trace accept accept-charset accept-encoding "
        "accept-language accept-ranges age allow authorization cache-control connection "
        "content-base content-encoding content-language content-length content-location "
        "content-md5 content-range content-type date etag expect expires from host if-match "
        "if-modified-since if-none-match if-range if-unmodified-since last-modified location "
        "max-forwards pragma proxy-authenticate proxy-authorization range referer retry-after "
        "server te trailer transfer-encoding upgrade user-agent vary via warning "
        "www-authenticate method get status 200_OK version HTTP/1.1 url public set-cookie "
        "keep-alive origin"
    ).split()
    tail = (
        "100101201202205206300302303304305306307402405406407408409410411412413414415416417"
        "502504505203 Non-Authoritative Information204 No Content301 Moved Permanently"
        "400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error"
        "501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct "
        "Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,"
        "image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,"
        "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,"
        "utf-,*,enq=0."
    )
    out = bytearray()
    for word in words:
        encoded = word.replace("_", " ").encode()  # "200 OK" is one word
        out += struct.pack(">I", len(encoded)) + encoded
    out += tail.encode()
    return bytes(out)


SPDY3_DICTIONARY = _spdy3_dictionary()


class FrameType(enum.IntEnum):
    SYN_STREAM = 1
    SYN_REPLY = 2
    RST_STREAM = 3
    SETTINGS = 4
    NOOP = 5  # SPDY/2 only; ignored if seen
    PING = 6
    GOAWAY = 7
    HEADERS = 8
    WINDOW_UPDATE = 9
    CREDENTIAL = 10  # never used by Kubernetes; ignored


class RstStatus(enum.IntEnum):
    PROTOCOL_ERROR = 1
    INVALID_STREAM = 2
    REFUSED_STREAM = 3
    UNSUPPORTED_VERSION = 4
    CANCEL = 5
    INTERNAL_ERROR = 6
    FLOW_CONTROL_ERROR = 7
    STREAM_IN_USE = 8
    STREAM_ALREADY_CLOSED = 9
    FRAME_TOO_LARGE = 11


FLAG_FIN = 0x01
FLAG_UNIDIRECTIONAL = 0x02
SETTINGS_INITIAL_WINDOW_SIZE = 7

# Header names are lower case on the wire; a value holding several values joins them
# with NUL, as the specification says.
Headers = dict[str, str]


@dataclass(frozen=True)
class SynStream:
    stream_id: int
    headers: Headers
    fin: bool = False
    unidirectional: bool = False
    associated_id: int = 0
    priority: int = 0


@dataclass(frozen=True)
class SynReply:
    stream_id: int
    headers: Headers
    fin: bool = False


@dataclass(frozen=True)
class RstStream:
    stream_id: int
    status: int


@dataclass(frozen=True)
class Settings:
    values: dict[int, int]
    flags: int = 0


@dataclass(frozen=True)
class Ping:
    ping_id: int


@dataclass(frozen=True)
class GoAway:
    last_good_stream_id: int
    status: int = 0


@dataclass(frozen=True)
class HeadersFrame:
    stream_id: int
    headers: Headers
    fin: bool = False


@dataclass(frozen=True)
class WindowUpdate:
    stream_id: int
    delta: int


@dataclass(frozen=True)
class Data:
    stream_id: int
    data: bytes
    fin: bool = False


Frame = (
    SynStream | SynReply | RstStream | Settings | Ping | GoAway | HeadersFrame | WindowUpdate | Data
)


class ProtocolError(Exception):
    """The peer broke the framing; the session cannot go on."""


class FrameCodec:
    """Encodes and decodes SPDY/3.1 frames. Keeps the two zlib contexts of one connection.

    The header compression context is shared by every header block of a direction, so the
    frames must be encoded in the order they are written, and decoded in arrival order.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._deflate = zlib.compressobj(
            zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, 15, 8, zlib.Z_DEFAULT_STRATEGY,
            zdict=SPDY3_DICTIONARY,
        )  # fmt: skip
        self._inflate = zlib.decompressobj(zdict=SPDY3_DICTIONARY)

    # -- decoding -----------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def frames(self) -> Iterator[Frame]:
        """Every complete frame buffered so far; incomplete data stays for the next feed."""
        while len(self._buffer) >= 8:
            first, flags_length = struct.unpack_from(">II", self._buffer)
            length = flags_length & 0xFFFFFF
            flags = flags_length >> 24
            if len(self._buffer) < 8 + length:
                return
            payload = bytes(self._buffer[8 : 8 + length])
            del self._buffer[: 8 + length]
            if first & 0x80000000:
                version = (first >> 16) & 0x7FFF
                if version != SPDY_VERSION:
                    raise ProtocolError(f"unsupported SPDY version {version}")
                frame = self._decode_control(first & 0xFFFF, flags, payload)
                if frame is not None:
                    yield frame
            else:
                yield Data(first & 0x7FFFFFFF, payload, bool(flags & FLAG_FIN))

    def _decode_control(self, kind: int, flags: int, payload: bytes) -> Frame | None:
        fin = bool(flags & FLAG_FIN)
        try:
            if kind == FrameType.SYN_STREAM:
                stream_id, assoc, prio = struct.unpack_from(">IIB", payload)
                headers = self._inflate_headers(payload[10:])
                return SynStream(
                    stream_id & 0x7FFFFFFF, headers, fin, bool(flags & FLAG_UNIDIRECTIONAL),
                    assoc & 0x7FFFFFFF, prio >> 5,
                )  # fmt: skip
            if kind == FrameType.SYN_REPLY:
                (stream_id,) = struct.unpack_from(">I", payload)
                return SynReply(stream_id & 0x7FFFFFFF, self._inflate_headers(payload[4:]), fin)
            if kind == FrameType.HEADERS:
                (stream_id,) = struct.unpack_from(">I", payload)
                headers = self._inflate_headers(payload[4:])
                return HeadersFrame(stream_id & 0x7FFFFFFF, headers, fin)
            if kind == FrameType.RST_STREAM:
                stream_id, status = struct.unpack_from(">II", payload)
                return RstStream(stream_id & 0x7FFFFFFF, status)
            if kind == FrameType.SETTINGS:
                (count,) = struct.unpack_from(">I", payload)
                values = {}
                for index in range(count):
                    id_flags, value = struct.unpack_from(">II", payload, 4 + 8 * index)
                    values[id_flags & 0xFFFFFF] = value
                return Settings(values, flags)
            if kind == FrameType.PING:
                return Ping(struct.unpack_from(">I", payload)[0])
            if kind == FrameType.GOAWAY:
                last, status = struct.unpack_from(">II", payload.ljust(8, b"\0"))
                return GoAway(last & 0x7FFFFFFF, status)
            if kind == FrameType.WINDOW_UPDATE:
                stream_id, delta = struct.unpack_from(">II", payload)
                return WindowUpdate(stream_id & 0x7FFFFFFF, delta & 0x7FFFFFFF)
        except struct.error as exc:
            raise ProtocolError(f"truncated {FrameType(kind).name} frame") from exc
        return None  # NOOP, CREDENTIAL and unknown control frames are ignored, as allowed

    def _inflate_headers(self, block: bytes) -> Headers:
        try:
            raw = self._inflate.decompress(block, MAX_HEADER_BLOCK)
        except zlib.error as exc:
            raise ProtocolError(f"bad header block: {exc}") from exc
        if self._inflate.unconsumed_tail:
            raise ProtocolError("header block too large")
        return decode_header_block(raw)

    # -- encoding -----------------------------------------------------------------------

    def encode(self, frame: Frame) -> bytes:
        if isinstance(frame, Data):
            flags = FLAG_FIN if frame.fin else 0
            return struct.pack(
                ">II", frame.stream_id & 0x7FFFFFFF, flags << 24 | len(frame.data)
            ) + (frame.data)
        if isinstance(frame, SynStream):
            flags = (FLAG_FIN if frame.fin else 0) | (
                FLAG_UNIDIRECTIONAL if frame.unidirectional else 0
            )
            body = struct.pack(
                ">IIBB", frame.stream_id, frame.associated_id, frame.priority << 5, 0
            )
            return self._control(
                FrameType.SYN_STREAM, flags, body + self._deflate_headers(frame.headers)
            )
        if isinstance(frame, SynReply):
            body = struct.pack(">I", frame.stream_id) + self._deflate_headers(frame.headers)
            return self._control(FrameType.SYN_REPLY, FLAG_FIN if frame.fin else 0, body)
        if isinstance(frame, HeadersFrame):
            body = struct.pack(">I", frame.stream_id) + self._deflate_headers(frame.headers)
            return self._control(FrameType.HEADERS, FLAG_FIN if frame.fin else 0, body)
        if isinstance(frame, RstStream):
            return self._control(
                FrameType.RST_STREAM, 0, struct.pack(">II", frame.stream_id, frame.status)
            )
        if isinstance(frame, Settings):
            body = struct.pack(">I", len(frame.values)) + b"".join(
                struct.pack(">II", key & 0xFFFFFF, value) for key, value in frame.values.items()
            )
            return self._control(FrameType.SETTINGS, frame.flags, body)
        if isinstance(frame, Ping):
            return self._control(FrameType.PING, 0, struct.pack(">I", frame.ping_id))
        if isinstance(frame, GoAway):
            body = struct.pack(">II", frame.last_good_stream_id, frame.status)
            return self._control(FrameType.GOAWAY, 0, body)
        if isinstance(frame, WindowUpdate):
            return self._control(
                FrameType.WINDOW_UPDATE, 0, struct.pack(">II", frame.stream_id, frame.delta)
            )
        raise TypeError(f"not a SPDY frame: {frame!r}")

    @staticmethod
    def _control(kind: FrameType, flags: int, body: bytes) -> bytes:
        return struct.pack(">HHI", 0x8000 | SPDY_VERSION, kind, flags << 24 | len(body)) + body

    def _deflate_headers(self, headers: Headers) -> bytes:
        raw = encode_header_block(headers)
        # A sync flush ends each block on a byte boundary without resetting the context,
        # which is what the peer's single inflate stream expects.
        return self._deflate.compress(raw) + self._deflate.flush(zlib.Z_SYNC_FLUSH)


def encode_header_block(headers: Headers) -> bytes:
    out = bytearray(struct.pack(">I", len(headers)))
    for name, value in headers.items():
        name_bytes, value_bytes = name.lower().encode(), value.encode()
        out += struct.pack(">I", len(name_bytes)) + name_bytes
        out += struct.pack(">I", len(value_bytes)) + value_bytes
    return bytes(out)


def decode_header_block(raw: bytes) -> Headers:
    try:
        (count,) = struct.unpack_from(">I", raw)
        offset, headers = 4, {}
        for _ in range(count):
            (size,) = struct.unpack_from(">I", raw, offset)
            name = raw[offset + 4 : offset + 4 + size].decode("latin-1").lower()
            offset += 4 + size
            (size,) = struct.unpack_from(">I", raw, offset)
            value = raw[offset + 4 : offset + 4 + size].decode("latin-1")
            offset += 4 + size
            if offset > len(raw):
                raise ProtocolError("header block shorter than its lengths")
            headers[name] = value
        return headers
    except struct.error as exc:
        raise ProtocolError("truncated header block") from exc


# ----------------------------------------------------------------------------------------
# Sessions


class ByteTransport(Protocol):
    """A reliable byte pipe: a TCP/TLS connection or a WebSocket carrying binary messages."""

    async def read(self) -> bytes:
        """Some bytes, or b"" once the peer has closed."""

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class StreamReset(ConnectionError):
    """The stream was reset by the peer or the session ended before it finished."""


@dataclass(eq=False)
class SpdyStream:
    """One SPDY stream: read() what the peer sends, write() and close() our half."""

    session: SpdySession
    stream_id: int
    headers: Headers
    _inbox: deque[bytes] = field(default_factory=deque)
    _buffered: int = 0
    _readable: asyncio.Event = field(default_factory=asyncio.Event)
    _remote_closed: bool = False
    _local_closed: bool = False
    _reset: bool = False
    send_window: int = INITIAL_WINDOW
    _window_open: asyncio.Event = field(default_factory=asyncio.Event)
    _unacked: int = 0
    replied: asyncio.Event = field(default_factory=asyncio.Event)
    reset_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self) -> bytes:
        """The next chunk the peer sent, or b"" once it closed its half (or reset)."""
        while not self._inbox:
            if self._remote_closed or self._reset:
                return b""
            self._readable.clear()
            await self._readable.wait()
        chunk = self._inbox.popleft()
        self._buffered -= len(chunk)
        await self.session._consumed(self, len(chunk))
        self.session._maybe_forget(self)
        return chunk

    async def write(self, data: bytes) -> None:
        """Send data, honouring flow control; raises StreamReset if the stream is gone."""
        await self.session._send_data(self, data)

    async def close(self) -> None:
        """Half-close our side (FIN). Reading may go on until the peer closes too."""
        if self._local_closed or self._reset:
            return
        self._local_closed = True
        with contextlib.suppress(ConnectionError):
            await self.session._send_frame(Data(self.stream_id, b"", fin=True))
        self.session._maybe_forget(self)

    async def reset(self, status: int = RstStatus.CANCEL) -> None:
        if self._reset:
            return
        self._mark_reset()
        with contextlib.suppress(ConnectionError):
            await self.session._send_frame(RstStream(self.stream_id, status))

    @property
    def remote_closed(self) -> bool:
        return self._remote_closed or self._reset

    def _deliver(self, data: bytes, fin: bool) -> None:
        if data:
            self._inbox.append(data)
            self._buffered += len(data)
        if fin:
            self._remote_closed = True
        self._readable.set()

    def _mark_reset(self) -> None:
        self._reset = True
        self.reset_seen.set()
        self._readable.set()
        self._window_open.set()
        self.replied.set()


class SpdySession:
    """A SPDY/3.1 session over a transport, as a server (peer opens odd streams) or client.

    Flow control: we grant the peer window as our readers consume data (WINDOW_UPDATE per
    stream and for the session). On the sending side we only hold back once the peer has
    shown that it does flow control (it sent a WINDOW_UPDATE or an initial window in
    SETTINGS): Go's spdystream, which kubectl and the API server use, speaks SPDY/3
    framing without ever granting window, and would stall after 64 KiB otherwise.
    """

    def __init__(self, transport: ByteTransport, *, server: bool) -> None:
        self._transport = transport
        self._codec = FrameCodec()
        self._server = server
        self._streams: dict[int, SpdyStream] = {}
        self._incoming: asyncio.Queue[SpdyStream | None] = asyncio.Queue()
        self._write_lock = asyncio.Lock()
        self._next_stream_id = 2 if server else 1
        self._next_ping_id = 2 if server else 1
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._last_peer_stream = 0
        self._peer_flow_control = False
        self._initial_send_window = INITIAL_WINDOW
        self._session_send_window = INITIAL_WINDOW
        self._session_window_open = asyncio.Event()
        self._session_window_open.set()
        self._session_unacked = 0
        self._room = asyncio.Event()
        self._room.set()
        self.closed = asyncio.Event()
        self.went_away = False

    # -- running ------------------------------------------------------------------------

    async def run(self) -> None:
        """Read frames until the transport ends. Always leaves `closed` set."""
        try:
            while True:
                data = await self._transport.read()
                if not data:
                    break
                self._codec.feed(data)
                for frame in self._codec.frames():
                    await self._handle(frame)
                # Back-pressure for peers that ignore flow control (see the class doc).
                await self._room.wait()
        except ProtocolError as exc:
            log.info("SPDY protocol error from peer: %s", exc)
            with contextlib.suppress(ConnectionError):
                await self._send_frame(GoAway(self._last_peer_stream, 1))
        except (ConnectionError, OSError) as exc:
            log.debug("SPDY transport ended: %s", exc)
        finally:
            self._end()

    def _end(self) -> None:
        self.closed.set()
        for stream in list(self._streams.values()):
            stream._mark_reset()
        self._streams.clear()
        self._session_window_open.set()
        for waiter in self._pings.values():
            if not waiter.done():
                waiter.set_exception(ConnectionError("session closed"))
        self._incoming.put_nowait(None)

    async def accept_stream(self) -> SpdyStream | None:
        """The next stream the peer opened (already replied to), or None once closed."""
        stream = await self._incoming.get()
        if stream is None:
            self._incoming.put_nowait(None)  # every later caller sees the end too
        return stream

    async def open_stream(self, headers: Headers, *, fin: bool = False) -> SpdyStream:
        """Open a stream of our own and wait for the peer's SYN_REPLY."""
        async with self._write_lock:
            stream_id = self._next_stream_id
            self._next_stream_id += 2
            stream = SpdyStream(self, stream_id, headers, send_window=self._initial_send_window)
            stream._window_open.set()
            self._streams[stream_id] = stream
            await self._write_locked(SynStream(stream_id, headers, fin=fin))
        if fin:
            stream._local_closed = True
        await stream.replied.wait()
        if stream._reset:
            raise StreamReset(f"stream {stream_id} was refused")
        return stream

    async def ping(self) -> None:
        ping_id = self._next_ping_id
        self._next_ping_id += 2
        waiter = asyncio.get_running_loop().create_future()
        self._pings[ping_id] = waiter
        try:
            await self._send_frame(Ping(ping_id))
            await waiter
        finally:
            self._pings.pop(ping_id, None)

    async def send_settings(self, values: dict[int, int]) -> None:
        await self._send_frame(Settings(values))

    async def close(self) -> None:
        """Say GOAWAY and close the transport; streams still open are reset locally."""
        if not self.closed.is_set():
            with contextlib.suppress(ConnectionError, OSError):
                await self._send_frame(GoAway(self._last_peer_stream, 0))
        with contextlib.suppress(ConnectionError, OSError):
            await self._transport.close()
        self._end()

    # -- frames in ----------------------------------------------------------------------

    async def _handle(self, frame: Frame) -> None:
        if isinstance(frame, Data):
            await self._on_data(frame)
        elif isinstance(frame, SynStream):
            await self._on_syn_stream(frame)
        elif isinstance(frame, SynReply):
            stream = self._streams.get(frame.stream_id)
            if stream is not None:
                stream.replied.set()
                if frame.fin:
                    stream._deliver(b"", True)
                    self._maybe_forget(stream)
        elif isinstance(frame, HeadersFrame):
            stream = self._streams.get(frame.stream_id)
            if stream is not None and frame.fin:
                stream._deliver(b"", True)
                self._maybe_forget(stream)
        elif isinstance(frame, RstStream):
            stream = self._streams.pop(frame.stream_id, None)
            if stream is not None:
                stream._mark_reset()
                self._update_room()
        elif isinstance(frame, WindowUpdate):
            self._on_window_update(frame)
        elif isinstance(frame, Settings):
            if SETTINGS_INITIAL_WINDOW_SIZE in frame.values:
                self._peer_flow_control = True
                new = frame.values[SETTINGS_INITIAL_WINDOW_SIZE]
                change = new - self._initial_send_window
                self._initial_send_window = new
                for stream in self._streams.values():
                    stream.send_window += change
                    self._update_window_event(stream)
        elif isinstance(frame, Ping):
            if frame.ping_id % 2 == self._next_ping_id % 2:
                waiter = self._pings.get(frame.ping_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            else:
                await self._send_frame(frame)  # the peer's ping: echo it
        elif isinstance(frame, GoAway):
            self.went_away = True

    async def _on_syn_stream(self, frame: SynStream) -> None:
        expected_parity = 1 if self._server else 0
        if frame.stream_id % 2 != expected_parity or frame.stream_id <= self._last_peer_stream:
            await self._send_frame(RstStream(frame.stream_id, RstStatus.PROTOCOL_ERROR))
            return
        self._last_peer_stream = frame.stream_id
        if sum(1 for sid in self._streams if sid % 2 == expected_parity) >= MAX_PEER_STREAMS:
            log.info(
                "SPDY peer opened more than %d streams: refusing %d",
                MAX_PEER_STREAMS,
                frame.stream_id,
            )
            await self._send_frame(RstStream(frame.stream_id, RstStatus.REFUSED_STREAM))
            return
        stream = SpdyStream(
            self, frame.stream_id, frame.headers, send_window=self._initial_send_window
        )
        stream._window_open.set()
        stream.replied.set()
        if frame.fin:
            stream._remote_closed = True
        if frame.unidirectional:
            stream._local_closed = True
        self._streams[frame.stream_id] = stream
        await self._send_frame(SynReply(frame.stream_id, {}))
        self._incoming.put_nowait(stream)

    async def _on_data(self, frame: Data) -> None:
        stream = self._streams.get(frame.stream_id)
        if stream is None or stream._remote_closed:
            # Data for a stream we no longer track (reset, or closed): the session window
            # still counts it, so give that back at once.
            if frame.data:
                await self._grant(0, len(frame.data))
            if stream is None and frame.stream_id <= self._last_peer_stream:
                return
            await self._send_frame(RstStream(frame.stream_id, RstStatus.INVALID_STREAM))
            return
        stream._deliver(frame.data, frame.fin)
        if frame.fin:
            self._maybe_forget(stream)
        self._update_room()

    def _on_window_update(self, frame: WindowUpdate) -> None:
        self._peer_flow_control = True
        if frame.stream_id == 0:
            self._session_send_window += frame.delta
            if self._session_send_window > 0:
                self._session_window_open.set()
            return
        stream = self._streams.get(frame.stream_id)
        if stream is not None:
            stream.send_window += frame.delta
            self._update_window_event(stream)

    @staticmethod
    def _update_window_event(stream: SpdyStream) -> None:
        if stream.send_window > 0:
            stream._window_open.set()
        else:
            stream._window_open.clear()

    def _update_room(self) -> None:
        streams = self._streams.values()
        if (
            any(s._buffered > MAX_BUFFERED_PER_STREAM for s in streams)
            or sum(s._buffered for s in streams) > MAX_BUFFERED_PER_SESSION
        ):
            self._room.clear()
        else:
            self._room.set()

    async def _consumed(self, stream: SpdyStream, size: int) -> None:
        """A reader took `size` bytes: grant that much window back, in batches."""
        self._update_room()
        if self.closed.is_set():
            return
        stream._unacked += size
        if stream._unacked >= INITIAL_WINDOW // 2 and not stream.remote_closed:
            delta, stream._unacked = stream._unacked, 0
            with contextlib.suppress(ConnectionError, OSError):
                await self._send_frame(WindowUpdate(stream.stream_id, delta))
        await self._grant(0, size)

    async def _grant(self, stream_id: int, size: int) -> None:
        self._session_unacked += size
        if self._session_unacked >= INITIAL_WINDOW // 2:
            delta, self._session_unacked = self._session_unacked, 0
            with contextlib.suppress(ConnectionError, OSError):
                await self._send_frame(WindowUpdate(stream_id, delta))

    # -- frames out ---------------------------------------------------------------------

    async def _send_frame(self, frame: Frame) -> None:
        async with self._write_lock:
            await self._write_locked(frame)

    async def _write_locked(self, frame: Frame) -> None:
        if self.closed.is_set() and not isinstance(frame, GoAway):
            raise ConnectionError("SPDY session closed")
        await self._transport.write(self._codec.encode(frame))

    async def _send_data(self, stream: SpdyStream, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if stream._reset or self.closed.is_set():
                raise StreamReset(f"stream {stream.stream_id} is closed")
            if stream._local_closed:
                raise StreamReset(f"stream {stream.stream_id} was already half-closed")
            size = min(len(view), MAX_DATA_CHUNK)
            if self._peer_flow_control:
                await stream._window_open.wait()
                await self._session_window_open.wait()
                if stream._reset or self.closed.is_set():
                    continue
                size = min(size, stream.send_window, self._session_send_window)
                if size <= 0:
                    if stream.send_window <= 0:
                        stream._window_open.clear()
                    if self._session_send_window <= 0:
                        self._session_window_open.clear()
                    continue
                stream.send_window -= size
                self._session_send_window -= size
                self._update_window_event(stream)
                if self._session_send_window <= 0:
                    self._session_window_open.clear()
            await self._send_frame(Data(stream.stream_id, bytes(view[:size])))
            view = view[size:]

    def _maybe_forget(self, stream: SpdyStream) -> None:
        if stream._local_closed and stream._remote_closed and not stream._inbox:
            self._streams.pop(stream.stream_id, None)
