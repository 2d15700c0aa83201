"""Draining a relayed HTTP/2 connection: the frame boundaries in both directions, the
GOAWAY the relay sends its client when the daemon stops, and the streams it then holds
back; and the server's half of the connection preface, which the relay answers itself
as soon as it accepts. Protocol logic only, no I/O (server/relay.py feeds it bytes).

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
8 s to load under emulation: cli.py accepts before loading them, server/activation.py
`EarlyAcceptor`). Answered at once, the connection is ready for the client,
which sends its calls; the relay forwards them once the gRPC server serves (after the
restore). The server's own SETTINGS follow as an update of the relay's, empty ones (the
protocol's defaults), and the client's acknowledgement of the relay's is not forwarded:
the server would take it for the acknowledgement of its own.
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
END_STREAM = 0x1
ACK = 0x1
NO_ERROR = 0x0
STREAM_ID_MASK = 0x7FFFFFFF


def frame(kind: int, stream: int, payload: bytes = b"", flags: int = 0) -> bytes:
    """One frame: its 9-byte header (length, type, flags, stream), then `payload`."""
    header = struct.pack(">I", len(payload))[1:] + bytes((kind, flags))
    return header + struct.pack(">I", stream & STREAM_ID_MASK) + payload


def settings_frame() -> bytes:
    """The server's connection preface: a SETTINGS frame, empty (HTTP/2's defaults)."""
    return frame(SETTINGS, 0)


def goaway_frame(last_stream_id: int, debug: bytes = b"") -> bytes:
    payload = struct.pack(">II", last_stream_id & STREAM_ID_MASK, NO_ERROR) + debug
    return frame(GOAWAY, 0, payload)


class OpenStreams:
    """The streams forwarded to the server and not yet answered in full.

    The daemon stops its gRPC server only once they are none: a stream the server had
    been sent but not yet taken up when it began to stop would be cancelled (CANCELLED),
    and the client must not retry it, since as far as it can tell the server saw it."""

    def __init__(self) -> None:
        self.ids: set[int] = set()

    def frame(self, kind: int, flags: int, stream: int) -> None:
        """A frame passed either way: a reset, or the server's END_STREAM, ends one."""
        if kind == RST_STREAM or (kind in (DATA, HEADERS) and flags & END_STREAM):
            self.ids.discard(stream)


class ClientToServer:
    """The client's bytes: passed through whole until the drain, then without the
    frames of streams the client opened after the last one forwarded."""

    def __init__(self, streams: OpenStreams) -> None:
        self.streams = streams
        self._preface = len(PREFACE)  # bytes of the preface still to pass
        self._buffer = bytearray()
        self.last_stream_id = 0  # the highest stream the server has been sent
        self._draining = False
        self._unforwarded_ack = False  # the client's next SETTINGS ACK is the relay's

    def preface_answered(self) -> None:
        """The relay sent the client its SETTINGS (settings_frame): the client's first
        acknowledgement is of those, not of the server's, and is not forwarded."""
        self._unforwarded_ack = True

    def drain(self) -> int:
        """From now on, hold back new streams; returns the last stream forwarded."""
        self._draining = True
        return self.last_stream_id

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward upstream for `data` from the client (a frame cut by the
        read is forwarded once it is whole)."""
        out = bytearray()
        if self._preface:
            taken = data[: self._preface]
            self._preface -= len(taken)
            out += taken
            data = data[len(taken) :]
        self._buffer += data
        at = 0
        while len(self._buffer) - at >= FRAME_HEADER:
            length = int.from_bytes(self._buffer[at : at + 3], "big")
            end = at + FRAME_HEADER + length
            if len(self._buffer) < end:
                break
            kind, flags = self._buffer[at + 3], self._buffer[at + 4]
            stream = int.from_bytes(self._buffer[at + 5 : at + 9], "big") & STREAM_ID_MASK
            if stream > self.last_stream_id and not self._draining and kind == HEADERS:
                self.last_stream_id = stream
                self.streams.ids.add(stream)
            if kind == SETTINGS and flags & ACK and self._unforwarded_ack:
                self._unforwarded_ack = False
            elif not (self._draining and stream > self.last_stream_id):
                out += self._buffer[at:end]
                if kind == RST_STREAM:
                    self.streams.frame(kind, 0, stream)
            at = end
        del self._buffer[:at]
        return bytes(out)


class ServerToClient:
    """The server's bytes, passed through at once (a frame's header once whole); tracks
    where frames end so that the relay's GOAWAY goes in between two of them, never inside
    one. While `holding`, the server's own GOAWAY frames are not passed: the relay tells
    the client itself, once, at the end of the stop."""

    def __init__(self, streams: OpenStreams) -> None:
        self.streams = streams
        self.holding = False
        self._left = 0  # bytes of the current frame still to come (0: at a boundary)
        self._dropping = False  # the current frame is not passed
        self._header = bytearray()  # a frame header cut by a read
        self._pending: bytes | None = None

    def insert(self, frame: bytes) -> bytes:
        """`frame` to send now if the stream is at a frame boundary (else b"": it goes
        out with the bytes that finish the current frame)."""
        if self._at_boundary():
            return frame
        self._pending = frame
        return b""

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        at = 0
        while at < len(data):
            if self._left:
                step = min(self._left, len(data) - at)
                if not self._dropping:
                    out += data[at : at + step]
                self._left -= step
                at += step
                continue
            if self._pending is not None and not self._header:
                out += self._pending  # the frame waiting goes in at this boundary
                self._pending = None
            need = FRAME_HEADER - len(self._header)
            self._header += data[at : at + need]
            at += min(need, len(data) - at)
            if len(self._header) < FRAME_HEADER:
                break
            kind, flags = self._header[3], self._header[4]
            stream = int.from_bytes(self._header[5:9], "big") & STREAM_ID_MASK
            self.streams.frame(kind, flags, stream)
            self._dropping = self.holding and kind == GOAWAY
            if not self._dropping:
                out += self._header
            self._left = int.from_bytes(self._header[:3], "big")
            self._header.clear()
        if self._pending is not None and self._at_boundary():
            out += self._pending
            self._pending = None
        return bytes(out)

    def _at_boundary(self) -> bool:
        return self._left == 0 and not self._header
