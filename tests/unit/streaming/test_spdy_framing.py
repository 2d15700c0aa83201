"""SPDY/3.1 framing: byte layouts from the specification, header compression, flow control."""

from __future__ import annotations

import asyncio
import struct
import zlib

import pytest

from cri_shim.streaming.spdy import (
    INITIAL_WINDOW,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SPDY3_DICTIONARY,
    Data,
    FrameCodec,
    GoAway,
    HeadersFrame,
    Ping,
    ProtocolError,
    RstStream,
    Settings,
    SpdySession,
    SynReply,
    SynStream,
    WindowUpdate,
    decode_header_block,
    encode_header_block,
)
from tests.waiting import until


def test_dictionary_is_the_spdy3_one() -> None:
    # 1423 bytes, starting with the length-prefixed "options" and ending with "enq=0.".
    assert len(SPDY3_DICTIONARY) == 1423
    assert SPDY3_DICTIONARY.startswith(b"\x00\x00\x00\x07options\x00\x00\x00\x04head")
    assert b"\x00\x00\x00\x06200 OK\x00\x00\x00\x07version" in SPDY3_DICTIONARY
    assert SPDY3_DICTIONARY.endswith(b"utf-,*,enq=0.")


def test_data_frame_layout() -> None:
    encoded = FrameCodec().encode(Data(5, b"abc", fin=True))

    assert encoded == struct.pack(">II", 5, 0x01 << 24 | 3) + b"abc"


@pytest.mark.parametrize(
    ("frame", "kind", "body"),
    [
        (RstStream(3, 5), 3, struct.pack(">II", 3, 5)),
        (Ping(7), 6, struct.pack(">I", 7)),
        (GoAway(9, 0), 7, struct.pack(">II", 9, 0)),
        (WindowUpdate(1, 4096), 9, struct.pack(">II", 1, 4096)),
        (Settings({7: 1024}), 4, struct.pack(">III", 1, 7, 1024)),
    ],
)
def test_control_frame_layout(frame: object, kind: int, body: bytes) -> None:
    encoded = FrameCodec().encode(frame)  # type: ignore[arg-type]

    assert encoded[:4] == struct.pack(">HH", 0x8003, kind)  # control bit, version 3, type
    assert encoded[4:8] == struct.pack(">I", len(body))
    assert encoded[8:] == body


def test_header_blocks_share_one_zlib_stream_primed_with_the_dictionary() -> None:
    sender = FrameCodec()
    first = sender.encode(SynStream(1, {"streamtype": "error"}))
    second = sender.encode(SynStream(3, {"streamtype": "stdout"}))

    # An independent inflater with the dictionary reads both blocks in sequence.
    inflate = zlib.decompressobj(zdict=SPDY3_DICTIONARY)
    assert decode_header_block(inflate.decompress(first[18:])) == {"streamtype": "error"}
    assert decode_header_block(inflate.decompress(second[18:])) == {"streamtype": "stdout"}
    # The zlib header names the dictionary by its Adler-32.
    assert first[20:24] == struct.pack(">I", zlib.adler32(SPDY3_DICTIONARY))


def test_codec_round_trip_with_frames_split_anywhere() -> None:
    frames = [
        SynStream(1, {"streamtype": "data", "port": "80", "requestid": "0"}, fin=False),
        SynReply(1, {}),
        HeadersFrame(1, {"x": "y"}, fin=True),
        Data(1, b"x" * 70000),
        Data(1, b"", fin=True),
        WindowUpdate(0, 123),
    ]
    sender, receiver = FrameCodec(), FrameCodec()
    wire = b"".join(sender.encode(frame) for frame in frames)

    decoded = []
    for start in range(0, len(wire), 7):  # frames cut at odd places
        receiver.feed(wire[start : start + 7])
        decoded.extend(receiver.frames())

    assert decoded == frames


def test_header_names_are_lower_cased() -> None:
    assert decode_header_block(encode_header_block({"StreamType": "error"})) == {
        "streamtype": "error"
    }


def test_wrong_version_is_a_protocol_error() -> None:
    codec = FrameCodec()
    codec.feed(struct.pack(">HHI", 0x8002, 6, 4) + b"\0\0\0\1")

    with pytest.raises(ProtocolError):
        list(codec.frames())


def test_corrupt_header_block_is_a_protocol_error() -> None:
    codec = FrameCodec()
    body = struct.pack(">IIBB", 1, 0, 0, 0) + b"not zlib at all"
    codec.feed(struct.pack(">HHI", 0x8003, 1, len(body)) + body)

    with pytest.raises(ProtocolError):
        list(codec.frames())


class _Pipe:
    """One direction of an in-memory byte transport."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.peer: _Pipe | None = None

    async def read(self) -> bytes:
        return await self.queue.get()

    async def write(self, data: bytes) -> None:
        assert self.peer is not None
        self.peer.queue.put_nowait(data)

    async def close(self) -> None:
        assert self.peer is not None
        self.peer.queue.put_nowait(b"")


def _pair() -> tuple[SpdySession, SpdySession]:
    a, b = _Pipe(), _Pipe()
    a.peer, b.peer = b, a
    return SpdySession(a, server=True), SpdySession(b, server=False)


async def test_sender_honours_a_peer_that_announces_flow_control() -> None:
    server, client = _pair()
    tasks = [asyncio.create_task(server.run()), asyncio.create_task(client.run())]
    try:
        await client.send_settings({SETTINGS_INITIAL_WINDOW_SIZE: 1000})
        opened = asyncio.create_task(client.open_stream({"streamtype": "stdout"}))
        accepted = await server.accept_stream()
        client_stream = await opened
        assert accepted is not None

        writing = asyncio.create_task(accepted.write(b"z" * 5000))
        await until(lambda: client_stream._buffered == 1000)
        await asyncio.sleep(0)
        assert not writing.done()  # stalled at the 1000-byte window
        # Reading the client's side grants window back only in batches of 32 KiB, so
        # grant explicitly as a flow-controlling client would.
        assert client_stream._buffered == 1000
        await client._send_frame(WindowUpdate(accepted.stream_id, 4000))
        await asyncio.wait_for(writing, 5)
        assert client_stream._buffered == 5000
    finally:
        await server.close()
        await client.close()
        for task in tasks:
            task.cancel()


async def test_sender_does_not_stall_on_a_peer_without_flow_control() -> None:
    # Go's spdystream never sends WINDOW_UPDATE; output past 64 KiB must still flow.
    server, client = _pair()
    tasks = [asyncio.create_task(server.run()), asyncio.create_task(client.run())]
    try:
        opened = asyncio.create_task(client.open_stream({"streamtype": "stdout"}))
        accepted = await server.accept_stream()
        client_stream = await opened
        assert accepted is not None

        await asyncio.wait_for(accepted.write(b"z" * (4 * INITIAL_WINDOW)), 5)
        await accepted.close()

        received = bytearray()
        while chunk := await client_stream.read():
            received += chunk
        assert len(received) == 4 * INITIAL_WINDOW
    finally:
        await server.close()
        await client.close()
        for task in tasks:
            task.cancel()


async def test_ping_from_the_peer_is_echoed() -> None:
    server, client = _pair()
    tasks = [asyncio.create_task(server.run()), asyncio.create_task(client.run())]
    try:
        await asyncio.wait_for(client.ping(), 5)
    finally:
        await server.close()
        await client.close()
        for task in tasks:
            task.cancel()
