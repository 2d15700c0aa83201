"""ttrpc, the lightweight RPC that NRI calls travel on, as a codec without I/O.

Each message is a 10-byte header (payload length and stream ID as 32-bit big-endian
numbers, a message type byte, a flags byte) and a payload of at most 4 MiB. A call is a
REQUEST message whose payload is an encoded `ttrpc.Request` (service, method, the method's
request message), answered by a RESPONSE message on the same stream whose payload is a
`ttrpc.Response` (a google.rpc status and the method's response message). The caller picks
the stream IDs: odd numbers counting up from 1. NRI makes only unary calls; DATA messages
(ttrpc's streams) are decoded but nothing here answers them.

`MessageCodec` turns received bytes into messages, h11-style; `Calls` is the caller's side
of the state (stream IDs, which calls are outstanding); the functions encode and decode the
envelopes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError

from cri_shim.nri.api import ttrpc_pb2

HEADER = struct.Struct(">IIBB")
MAX_MESSAGE = 4 << 20
MAX_STREAM_ID = 0xFFFFFFFF


class MessageType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


FLAG_REMOTE_CLOSED = 0x1
FLAG_REMOTE_OPEN = 0x2
FLAG_NO_DATA = 0x4


class Code(enum.IntEnum):
    """The gRPC status codes, which ttrpc's responses carry."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class TtrpcError(Exception):
    """The peer broke the protocol; the connection cannot go on."""


class Oversize(ValueError):
    """A message to send is larger than MAX_MESSAGE."""


class CallError(Exception):
    """A call answered with a status other than OK."""

    def __init__(self, code: int, message: str) -> None:
        try:
            self.code: int = Code(code)
        except ValueError:
            self.code = code
        self.message = message
        name = self.code.name if isinstance(self.code, Code) else str(code)
        super().__init__(f"{name}: {message}")


@dataclass(frozen=True)
class Message:
    stream_id: int
    type: int
    flags: int
    payload: bytes


@dataclass(frozen=True)
class Oversized:
    """A message past MAX_MESSAGE arrived; its payload was skipped, unread.

    A REQUEST deserves a RESOURCE_EXHAUSTED answer on its stream, as ttrpc gives.
    """

    stream_id: int
    type: int
    length: int


Event = Message | Oversized
Envelope = TypeVar("Envelope", ttrpc_pb2.Request, ttrpc_pb2.Response)


def encode_message(stream_id: int, type: int, payload: bytes, flags: int = 0) -> bytes:
    if len(payload) > MAX_MESSAGE:
        raise Oversize(f"message of {len(payload)} bytes is larger than {MAX_MESSAGE}")
    if not 0 <= stream_id <= MAX_STREAM_ID:
        raise ValueError(f"stream ID {stream_id} does not fit 32 bits")
    return HEADER.pack(len(payload), stream_id, type, flags) + payload


class MessageCodec:
    """Decodes the ttrpc messages of one (logical) connection, in arrival order."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._skipping = 0  # bytes of an oversized payload still to throw away

    @property
    def pending(self) -> int:
        """Bytes received that do not make a whole message yet."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Event]:
        """Take bytes from the connection; return the messages they complete."""
        view = memoryview(data)
        if self._skipping:
            skipped = min(self._skipping, len(view))
            self._skipping -= skipped
            view = view[skipped:]
        self._buffer += view
        events: list[Event] = []
        offset = 0
        while len(self._buffer) - offset >= HEADER.size:
            length, stream_id, type_, flags = HEADER.unpack_from(self._buffer, offset)
            start = offset + HEADER.size
            if length > MAX_MESSAGE:
                events.append(Oversized(stream_id, type_, length))
                available = len(self._buffer) - start
                self._skipping = max(0, length - available)
                offset = start + min(length, available)
                continue
            end = start + length
            if end > len(self._buffer):
                break
            events.append(Message(stream_id, type_, flags, bytes(self._buffer[start:end])))
            offset = end
        del self._buffer[:offset]
        return events


@dataclass(frozen=True)
class Request:
    """A call as its server sees it."""

    stream_id: int
    service: str
    method: str
    payload: bytes
    timeout_ns: int
    metadata: tuple[tuple[str, str], ...]


def _parse(envelope: Envelope, message: Message) -> Envelope:
    try:
        envelope.ParseFromString(message.payload)
    except DecodeError as e:
        what = MessageType(message.type).name.lower()
        raise TtrpcError(f"{what} on stream {message.stream_id} does not decode: {e}") from e
    return envelope


def decode_request(message: Message) -> Request:
    envelope = _parse(ttrpc_pb2.Request(), message)
    return Request(
        stream_id=message.stream_id,
        service=envelope.service,
        method=envelope.method,
        payload=envelope.payload,
        timeout_ns=envelope.timeout_nano,
        metadata=tuple((kv.key, kv.value) for kv in envelope.metadata),
    )


def encode_response(
    stream_id: int, payload: bytes = b"", code: int = Code.OK, message: str = ""
) -> bytes:
    """The answer to one call: the method's response, or a status that is not OK."""
    envelope = ttrpc_pb2.Response(payload=payload)
    envelope.status.code = code
    envelope.status.message = message
    encoded = envelope.SerializeToString()
    if len(encoded) > MAX_MESSAGE:
        envelope = ttrpc_pb2.Response()
        envelope.status.code = Code.RESOURCE_EXHAUSTED
        envelope.status.message = f"response of {len(encoded)} bytes exceeds {MAX_MESSAGE}"
        encoded = envelope.SerializeToString()
    return encode_message(stream_id, MessageType.RESPONSE, encoded)


def decode_response(message: Message) -> bytes:
    """The method's response message; raises CallError for a status that is not OK."""
    envelope = _parse(ttrpc_pb2.Response(), message)
    if envelope.status.code != Code.OK:
        raise CallError(envelope.status.code, envelope.status.message)
    return envelope.payload


class Calls:
    """The caller's side of one connection: stream IDs and the calls still unanswered."""

    def __init__(self) -> None:
        self._next = 1
        self._outstanding: dict[int, str] = {}

    @property
    def outstanding(self) -> dict[int, str]:
        """Stream ID → "service/method" of every call without an answer yet."""
        return dict(self._outstanding)

    def start(
        self, service: str, method: str, payload: bytes, timeout_ns: int = 0
    ) -> tuple[int, bytes]:
        """A new call: its stream ID and the bytes to send."""
        if self._next > MAX_STREAM_ID:
            raise TtrpcError("stream IDs are used up; the connection must be reopened")
        envelope = ttrpc_pb2.Request(
            service=service, method=method, payload=payload, timeout_nano=timeout_ns
        )
        data = encode_message(self._next, MessageType.REQUEST, envelope.SerializeToString())
        stream_id = self._next
        self._outstanding[stream_id] = f"{service}/{method}"
        self._next += 2
        return stream_id, data

    def abandon(self, stream_id: int) -> None:
        """Forget a call given up on (timed out); a late answer to it is then ignored."""
        self._outstanding.pop(stream_id, None)

    def receive(self, event: Event) -> tuple[int, bytes | CallError] | None:
        """The call a received message answers, and its result; None if it answers none.

        A response to a stream nobody waits for (a call abandoned) is dropped.
        """
        if isinstance(event, Oversized):
            if event.type != MessageType.RESPONSE or event.stream_id not in self._outstanding:
                return None
            del self._outstanding[event.stream_id]
            return event.stream_id, CallError(
                Code.RESOURCE_EXHAUSTED,
                f"response of {event.length} bytes exceeds {MAX_MESSAGE}",
            )
        if event.type != MessageType.RESPONSE:
            raise TtrpcError(
                f"message of type {event.type} on stream {event.stream_id} is not a response"
            )
        if self._outstanding.pop(event.stream_id, None) is None:
            return None
        try:
            return event.stream_id, decode_response(event)
        except CallError as e:
            return event.stream_id, e
