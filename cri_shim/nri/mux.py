"""NRI's connection multiplexing: two logical connections over one plugin socket.

A plugin connection carries the calls the runtime makes to the plugin (the plugin serves
them on `PLUGIN_SERVICE_CONN`) and the calls the plugin makes to the runtime (served by the
runtime on `RUNTIME_SERVICE_CONN`). Every write on a logical connection travels as frames
of an 8-byte header (connection ID, payload length; both 32-bit big-endian) and the
payload. The payload of a frame is a slice of the logical connection's byte stream, not a
message: a receiver joins the frames of one connection and reads them as a stream.

`MuxCodec` is the byte-level part, without I/O, in the style of h11: feed it what the
socket gave, take the frames it could complete.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from cri_shim.nri import ttrpc

HEADER = struct.Struct(">II")
# Connection 0 is reserved; a frame for it, or for any connection nobody opened, is dropped.
RESERVED_CONN = 0
PLUGIN_SERVICE_CONN = 1
RUNTIME_SERVICE_CONN = 2
# The largest payload of one frame: a whole ttrpc message of the largest size. A writer
# splits anything longer; a reader refuses a frame that claims more (a guard against a
# peer that would have us allocate gigabytes).
MAX_FRAME_PAYLOAD = ttrpc.HEADER.size + ttrpc.MAX_MESSAGE


class MuxError(Exception):
    """The peer broke the framing; the plugin connection cannot go on."""


@dataclass(frozen=True)
class Frame:
    conn_id: int
    payload: bytes


def encode(conn_id: int, data: bytes) -> bytes:
    """The frames that carry one write of `data` on a logical connection.

    An empty write is one frame with no payload, as the reference implementation sends.
    """
    if not 0 <= conn_id <= 0xFFFFFFFF:
        raise ValueError(f"connection ID {conn_id} does not fit 32 bits")
    if not data:
        return HEADER.pack(conn_id, 0)
    out = bytearray()
    view = memoryview(data)
    for start in range(0, len(view), MAX_FRAME_PAYLOAD):
        chunk = view[start : start + MAX_FRAME_PAYLOAD]
        out += HEADER.pack(conn_id, len(chunk))
        out += chunk
    return bytes(out)


class MuxCodec:
    """Decodes the frames of one plugin connection, in arrival order."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    @property
    def pending(self) -> int:
        """Bytes received that do not make a whole frame yet."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """Take bytes from the socket; return the frames they complete.

        Raises MuxError when a header claims a payload past MAX_FRAME_PAYLOAD.
        """
        self._buffer += data
        frames: list[Frame] = []
        offset = 0
        while len(self._buffer) - offset >= HEADER.size:
            conn_id, length = HEADER.unpack_from(self._buffer, offset)
            if length > MAX_FRAME_PAYLOAD:
                raise MuxError(
                    f"frame of {length} bytes on connection {conn_id} is larger than "
                    f"{MAX_FRAME_PAYLOAD}"
                )
            end = offset + HEADER.size + length
            if end > len(self._buffer):
                break
            frames.append(Frame(conn_id, bytes(self._buffer[offset + HEADER.size : end])))
            offset = end
        del self._buffer[:offset]
        return frames
