"""Draining a relayed HTTP/2 connection: the frame boundaries in both directions, the
GOAWAY the relay sends its client when the daemon stops, and the streams it then holds
back; and the server's half of the connection preface, which the relay answers itself
as soon as it accepts. Protocol logic only, no I/O (transport/relay.py feeds it bytes).

Why the relay says GOAWAY itself rather than leaving it to gRPC's server: a client that
opens a stream while the server is closing the connection behind the relay sees that
stream fail UNAVAILABLE, since it cannot know whether the server saw it. A GOAWAY naming
the last stream forwarded tells it, by HTTP/2's rules (RFC 9113 §6.8), that every later
stream was never processed, and gRPC clients (grpc-core, grpc-go: kubelet) then retry
those on a new connection, which waits in the activated socket's backlog for the next
daemon. So from the drain on, frames of streams above that number are not forwarded:
the server must not start what the client will retry.

Why the GOAWAY comes at the end of the stop, and the server's own are not passed: a gRPC
client retries a call so only once (grpc-go's first attempt, grpc-core's one retry of a
stream the server never saw). Told at the start of the stop, a client would retry at once
on a new connection; left unanswered until the next daemon, that connection is closed by
kubelet after 5 s (below), and answered and held by the stopping relay, the call would
be told a second time and fail. Held on its connection until the stopping daemon's last
step, the call is retried once, on a connection that only the next daemon takes.

Why the relay answers the preface: a gRPC client gives a new connection a deadline to
receive the server's preface (kubelet's cri-client: 5 s, its minimum connect timeout;
grpc-go's default: 20 s), then closes it and fails the calls waiting for it UNAVAILABLE.
A connection waiting in the activated socket's backlog while the daemon restarts and
restores would be closed so whenever that takes longer (the daemon's modules alone took
8 s to load under emulation: cli.py accepts before loading them, transport/activation.py
`EarlyAcceptor`). Answered at once, the connection is ready for the client,
which sends its calls; the relay forwards them once the gRPC server serves (after the
restore). The server's own SETTINGS follow as an update of the relay's, empty ones (the
protocol's defaults), and the client's acknowledgement of the relay's is not forwarded:
the server would take it for the acknowledgement of its own.

Why a client's frame is bounded: the relay forwards a client's frame once it is whole,
so it would hold as much as a frame header claims (16 MiB). It takes frames up to
HTTP/2's default SETTINGS_MAX_FRAME_SIZE, which its own SETTINGS leave in place and the
server's are kept from raising (gRPC's say 4 MiB), and ends a connection that sends a
longer one with GOAWAY FRAME_SIZE_ERROR, as RFC 9113 §4.2 has it.

Why a stopping daemon ends the calls whose request never ended: it waits for the calls it
forwarded to be answered, and a call whose client never finished sending its request
(END_STREAM) would make it wait for as long as it waits for any (30 s), holding every new
call meanwhile. Such a call has not started (every CRI call takes one whole message), so
after a short grace the relay resets it towards the server and answers the client a gRPC
status itself (status_frame).
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = 9
DATA = 0x0
HEADERS = 0x1
RST_STREAM = 0x3
SETTINGS = 0x4
GOAWAY = 0x7
CONTINUATION = 0x9
END_STREAM = 0x1
END_HEADERS = 0x4
ACK = 0x1
NO_ERROR = 0x0
FRAME_SIZE_ERROR = 0x6
CANCEL = 0x8
STREAM_ID_MASK = 0x7FFFFFFF
SETTINGS_MAX_FRAME_SIZE = 0x5
# The longest frame a client may send: HTTP/2's default, the relay's advertised value.
MAX_FRAME_SIZE = 16384
# gRPC's UNAVAILABLE: the call was not served here, and may be retried.
GRPC_UNAVAILABLE = 14

# A frame's header: its length (24 bits, read as 16 + 8), type, flags and stream.
_HEADER = struct.Struct(">HBBBI")
_SETTING = struct.Struct(">HI")
# What ServerToClient does with one of the server's frames.
_PASS, _DROP, _REWRITE = 0, 1, 2


class FrameTooLarge(Exception):
    """A client's frame is longer than the relay lets it send (MAX_FRAME_SIZE)."""

    def __init__(self, length: int) -> None:
        super().__init__(f"a frame of {length} bytes, over the {MAX_FRAME_SIZE} advertised")
        self.length = length


def frame(kind: int, stream: int, payload: bytes = b"", flags: int = 0) -> bytes:
    """One frame: its 9-byte header (length, type, flags, stream), then `payload`."""
    header = struct.pack(">I", len(payload))[1:] + bytes((kind, flags))
    return header + struct.pack(">I", stream & STREAM_ID_MASK) + payload


def settings_frame() -> bytes:
    """The server's connection preface: a SETTINGS frame, empty (HTTP/2's defaults)."""
    return frame(SETTINGS, 0)


def goaway_frame(last_stream_id: int, debug: bytes = b"", error: int = NO_ERROR) -> bytes:
    payload = struct.pack(">II", last_stream_id & STREAM_ID_MASK, error) + debug
    return frame(GOAWAY, 0, payload)


def reset_frame(stream: int, error: int = CANCEL) -> bytes:
    return frame(RST_STREAM, stream, struct.pack(">I", error))


def status_frame(stream: int, code: int, message: str, answer_begun: bool) -> bytes:
    """A gRPC status that ends `stream`: its trailers, or a trailers-only answer (HTTP's
    status and gRPC's content type first) when the server sent no headers on it. The
    fields are HPACK literals without indexing (RFC 7541 §6.2.2), which leave both
    sides' header tables as they were; `message` is printable ASCII without '%' (gRPC
    percent-encodes the rest)."""
    fields = [] if answer_begun else [(b":status", b"200"), (b"content-type", b"application/grpc")]
    fields += [(b"grpc-status", b"%d" % code), (b"grpc-message", message.encode("ascii"))]
    block = b"".join(b"\0" + _hpack_string(name) + _hpack_string(value) for name, value in fields)
    return frame(HEADERS, stream, block, flags=END_HEADERS | END_STREAM)


def _hpack_string(text: bytes) -> bytes:
    """A string literal, not Huffman-coded: its length as HPACK's 7-bit-prefix integer."""
    length, out = len(text), bytearray()
    if length < 0x7F:
        return bytes((length,)) + text
    out.append(0x7F)
    length -= 0x7F
    while length >= 0x80:
        out.append(length & 0x7F | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out) + text


class OpenStreams:
    """The streams forwarded to the server and not yet answered in full.

    The daemon stops its gRPC server only once they are none: a stream the server had
    been sent but not yet taken up when it began to stop would be cancelled (CANCELLED),
    and the client must not retry it, since as far as it can tell the server saw it."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.unfinished: set[int] = set()  # of `ids`, those whose request has not ended
        self.answer_begun: set[int] = set()  # of `ids`, those the server sent headers on
        self.ended: set[int] = set()  # ended by the relay: their later frames are dropped

    def opened(self, stream: int) -> None:
        self.ids.add(stream)
        self.unfinished.add(stream)

    def closed(self, stream: int) -> None:
        self.ids.discard(stream)
        self.unfinished.discard(stream)
        self.answer_begun.discard(stream)


class ClientToServer:
    """The client's bytes, a frame forwarded once whole (so that the relay can put one of
    its own between any two): passed through until the drain, then without the frames
    of streams the client opened after the last one forwarded. A read of whole frames
    that all pass is forwarded as it is, not copied."""

    def __init__(self, streams: OpenStreams) -> None:
        self.streams = streams
        self._preface = len(PREFACE)  # bytes of the preface still to pass
        self._buffer = bytearray()  # the start of a frame cut by a read
        self.last_stream_id = 0  # the highest stream the server has been sent
        self._draining = False
        self._unforwarded_ack = False  # the client's next SETTINGS ACK is the relay's
        self._in_block = False  # a header block is open: its CONTINUATION comes next
        self._pending = b""  # the relay's frames, to go in once the header block ends

    def preface_answered(self) -> None:
        """The relay sent the client its SETTINGS (settings_frame): the client's first
        acknowledgement is of those, not of the server's, and is not forwarded."""
        self._unforwarded_ack = True

    def drain(self) -> int:
        """From now on, hold back new streams; returns the last stream forwarded."""
        self._draining = True
        return self.last_stream_id

    def insert(self, frame: bytes) -> bytes:
        """`frame` to send the server now, or b"" when a header block is open: it then
        goes out with the frame that ends the block."""
        if not self._in_block:
            return frame
        self._pending += frame
        return b""

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward upstream for `data` from the client; FrameTooLarge when
        a frame is longer than the client may send."""
        source: bytes | bytearray = data
        if self._buffer:
            self._buffer += data
            source = self._buffer
        at, size = 0, len(source)
        if self._preface:
            at = min(self._preface, size)
            self._preface -= at
        kept: bytearray | None = None  # made once a frame is left out or one put in
        while size - at >= FRAME_HEADER:
            high, low, kind, flags, stream = _HEADER.unpack_from(source, at)
            length = high << 8 | low
            if length > MAX_FRAME_SIZE:
                raise FrameTooLarge(length)
            end = at + FRAME_HEADER + length
            if end > size:
                break
            if self._passes(kind, flags, stream & STREAM_ID_MASK):
                if kept is not None:
                    kept += source[at:end]
                if self._pending and not self._in_block:
                    if kept is None:
                        kept = bytearray(source[:end])
                    kept += self._pending
                    self._pending = b""
            elif kept is None:
                kept = bytearray(source[:at])
            at = end
        if source is data:
            if at < size:
                self._buffer += data[at:]
                return data[:at] if kept is None else bytes(kept)
            return data if kept is None else bytes(kept)
        out = bytes(source[:at]) if kept is None else bytes(kept)
        del self._buffer[:at]
        return out

    def _passes(self, kind: int, flags: int, stream: int) -> bool:
        if kind == HEADERS and stream > self.last_stream_id and not self._draining:
            self.last_stream_id = stream
            self.streams.opened(stream)
        elif kind == SETTINGS and flags & ACK and self._unforwarded_ack:
            self._unforwarded_ack = False
            return False
        if (self._draining and stream > self.last_stream_id) or stream in self.streams.ended:
            return False  # held back since the drain, or ended by the relay
        if kind == RST_STREAM:
            self.streams.closed(stream)
        elif flags & END_STREAM and kind in (DATA, HEADERS):
            self.streams.unfinished.discard(stream)
        if kind == HEADERS or kind == CONTINUATION:
            self._in_block = not flags & END_HEADERS
        return True


class ServerToClient:
    """The server's bytes, passed through at once (a frame's header once whole); tracks
    where frames end so that the relay's frames go in between two of them, never inside
    one or inside a header block. While `holding`, the server's own GOAWAY frames are
    not passed: the relay tells the client itself, once, at the end of the stop. The
    server's SETTINGS pass with SETTINGS_MAX_FRAME_SIZE no higher than the relay takes.
    A read whose bytes all pass is returned as it is, not copied."""

    def __init__(self, streams: OpenStreams) -> None:
        self.streams = streams
        self.holding = False
        self._left = 0  # bytes of the current frame still to come (0: at a boundary)
        self._dropping = False  # the current frame is not passed
        self._settings: bytearray | None = None  # the current frame, SETTINGS, so far
        self._header = bytearray()  # a frame header cut by a read
        self._in_block = False  # a header block is open: its CONTINUATION comes next
        self._pending = b""

    def insert(self, frame: bytes) -> bytes:
        """`frame` to send now if the stream is at a frame boundary (else b"": it goes
        out with the bytes that finish the current frame or header block)."""
        if self._at_boundary():
            return frame
        self._pending += frame
        return b""

    def feed(self, data: bytes) -> bytes:
        out: bytearray | None = None  # made once what passes differs from `data`
        run = at = 0  # data[run:at] passes and is not yet in `out`
        size = len(data)
        while at < size:
            if self._left:
                step = min(self._left, size - at)
                if self._dropping or self._settings is not None:
                    out = _flushed(out, data, run, at)
                    if self._settings is not None:
                        self._settings += data[at : at + step]
                    run = at + step
                self._left -= step
                at += step
                if not self._left and self._settings is not None:
                    out = _flushed(out, data, run, run)
                    out += self._settings_passed()
                continue
            if self._pending and self._at_boundary():
                out = _flushed(out, data, run, at)
                out += self._pending
                self._pending = b""
                run = at
            if self._header or size - at < FRAME_HEADER:  # a header cut by the read
                out = _flushed(out, data, run, at)
                need = FRAME_HEADER - len(self._header)
                self._header += data[at : at + need]
                at = run = min(at + need, size)
                if len(self._header) < FRAME_HEADER:
                    break
                cut = bytes(self._header)
                self._header.clear()
                high, low, kind, flags, stream = _HEADER.unpack_from(cut)
                header: bytes | None = cut
            else:
                header = None
                high, low, kind, flags, stream = _HEADER.unpack_from(data, at)
                at += FRAME_HEADER
            self._left = high << 8 | low
            action = self._action(kind, flags, stream & STREAM_ID_MASK)
            self._dropping = action == _DROP
            if header is not None:
                if action == _PASS:
                    out = _flushed(out, data, run, run)
                    out += header
            elif action != _PASS:
                out = _flushed(out, data, run, at - FRAME_HEADER)
                run = at
                header = data[at - FRAME_HEADER : at]
            if action == _REWRITE:
                assert header is not None
                self._settings = bytearray(header)
                if not self._left:
                    out = _flushed(out, data, run, run)
                    out += self._settings_passed()
        if self._pending and self._at_boundary():
            out = _flushed(out, data, run, size)
            out += self._pending
            self._pending = b""
            run = size
        if out is None:
            return data
        out += data[run:]
        return bytes(out)

    def _action(self, kind: int, flags: int, stream: int) -> int:
        if stream and stream in self.streams.ended:
            return _DROP
        if kind == HEADERS or kind == DATA:
            if flags & END_STREAM:
                self.streams.closed(stream)
            elif kind == HEADERS and stream in self.streams.ids:
                self.streams.answer_begun.add(stream)
        elif kind == RST_STREAM:
            self.streams.closed(stream)
        elif kind == GOAWAY and self.holding:
            return _DROP
        elif kind == SETTINGS and not flags & ACK:
            return _REWRITE
        if kind == HEADERS or kind == CONTINUATION:
            self._in_block = not flags & END_HEADERS
        return _PASS

    def _settings_passed(self) -> bytearray:
        """The server's SETTINGS, SETTINGS_MAX_FRAME_SIZE lowered to what the relay takes."""
        whole, self._settings = self._settings, None
        assert whole is not None
        for at in range(FRAME_HEADER, len(whole) - _SETTING.size + 1, _SETTING.size):
            setting, value = _SETTING.unpack_from(whole, at)
            if setting == SETTINGS_MAX_FRAME_SIZE and value > MAX_FRAME_SIZE:
                _SETTING.pack_into(whole, at, setting, MAX_FRAME_SIZE)
        return whole

    def _at_boundary(self) -> bool:
        return self._left == 0 and not self._header and not self._in_block


def _flushed(out: bytearray | None, data: bytes, start: int, end: int) -> bytearray:
    """`out` with data[start:end] added; made, from what passed before, if None."""
    if out is None:
        return bytearray(data[:end])
    out += data[start:end]
    return out
