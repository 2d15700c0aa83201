"""The relay's HTTP/2 drain: frames passed whole each way, a GOAWAY put between two of
the server's frames, streams opened after the drain held back, answered streams
followed."""

from __future__ import annotations

import struct

import pytest

from cri_shim.transport.http2_drain import (
    DATA,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_FRAME_SIZE,
    PREFACE,
    RST_STREAM,
    SETTINGS_MAX_FRAME_SIZE,
    ClientToServer,
    FrameTooLarge,
    OpenStreams,
    ServerToClient,
    frame,
    goaway_frame,
)

SETTINGS = 0x4
WINDOW_UPDATE = 0x8


def in_pieces(data: bytes, size: int) -> list[bytes]:
    return [data[at : at + size] for at in range(0, len(data), size)]


def fed(side: ClientToServer | ServerToClient, data: bytes, size: int) -> bytes:
    return b"".join(side.feed(piece) for piece in in_pieces(data, size))


CLIENT = (
    PREFACE
    + frame(SETTINGS, 0, b"\0\x03\0\0\0\x64")
    + frame(HEADERS, 1, b"h" * 40, flags=0x4)
    + frame(DATA, 1, b"d" * 70, flags=END_STREAM)
    + frame(HEADERS, 3, b"h" * 12, flags=0x4)
)


@pytest.mark.parametrize("size", [1, 5, 9, 10, 64, 4096])
def test_the_client_bytes_pass_whole_however_they_are_read(size: int) -> None:
    streams = OpenStreams()
    inbound = ClientToServer(streams)
    assert fed(inbound, CLIENT, size) == CLIENT
    assert inbound.last_stream_id == 3
    assert streams.ids == {1, 3}


def test_after_the_drain_new_streams_are_held_back() -> None:
    streams = OpenStreams()
    inbound = ClientToServer(streams)
    inbound.feed(CLIENT)
    assert inbound.drain() == 3
    later = (
        frame(HEADERS, 5, b"h" * 9, flags=0x4)
        + frame(DATA, 3, b"still stream 3", flags=END_STREAM)
        + frame(DATA, 5, b"body of 5", flags=END_STREAM)
        + frame(WINDOW_UPDATE, 0, b"\0\0\x10\0")
    )
    # Stream 3's frames and the connection's go on; stream 5's never reach the server.
    assert fed(inbound, later, 7) == (
        frame(DATA, 3, b"still stream 3", flags=END_STREAM) + frame(WINDOW_UPDATE, 0, b"\0\0\x10\0")
    )
    assert inbound.last_stream_id == 3
    assert streams.ids == {1, 3}


def test_streams_end_with_the_servers_end_stream_or_a_reset() -> None:
    streams = OpenStreams()
    inbound, outbound = ClientToServer(streams), ServerToClient(streams)
    inbound.feed(CLIENT + frame(HEADERS, 5, b"h", flags=0x4))
    assert streams.ids == {1, 3, 5}
    # Headers, then data, then trailers ending stream 1; stream 3 ends on its data.
    answers = (
        frame(HEADERS, 1, b"r" * 5, flags=0x4)
        + frame(DATA, 1, b"x" * 30)
        + frame(HEADERS, 1, b"t" * 4, flags=0x4 | END_STREAM)
        + frame(DATA, 3, b"y", flags=END_STREAM)
    )
    assert fed(outbound, answers, 4) == answers
    assert streams.ids == {5}
    inbound.feed(frame(RST_STREAM, 5, b"\0\0\0\x08"))  # the client gave up on it
    assert streams.ids == set()


def test_the_goaway_goes_out_at_once_between_frames() -> None:
    outbound = ServerToClient(OpenStreams())
    outbound.feed(frame(SETTINGS, 0) + frame(DATA, 1, b"abc"))
    goaway = goaway_frame(7)
    assert outbound.insert(goaway) == goaway


@pytest.mark.parametrize("cut", [2, 9, 12])  # in the header, at its end, in the payload
def test_the_goaway_waits_for_the_end_of_a_frame_cut_by_a_read(cut: int) -> None:
    outbound = ServerToClient(OpenStreams())
    current = frame(DATA, 1, b"payload-of-stream-1")
    after = frame(DATA, 1, b"next", flags=END_STREAM)
    passed = outbound.feed(current[:cut])
    assert passed == (current[:cut] if cut >= 9 else b"")  # a header passes once whole
    goaway = goaway_frame(1)
    assert outbound.insert(goaway) == b""
    assert passed + outbound.feed(current[cut:] + after) == current + goaway + after


@pytest.mark.parametrize("size", [1, 5, 9, 100])
def test_while_holding_the_servers_goaway_is_not_passed(size: int) -> None:
    """The server's GOAWAYs as grpc-core's stop sends them (the first naming every
    stream, then a PING, then the last stream it took) are the relay's to say: the
    client would retry its held calls at once, on a connection the stopping relay takes,
    and would fail them when told a second time."""
    outbound = ServerToClient(OpenStreams())
    answer = frame(HEADERS, 1, b"t" * 4, flags=0x4 | END_STREAM)
    assert fed(outbound, answer, size) == answer
    outbound.holding = True
    ping = frame(0x6, 0, b"p" * 8)
    stop = goaway_frame(0x7FFFFFFF) + ping + goaway_frame(1, b"server shutdown")
    assert fed(outbound, stop + answer, size) == ping + answer


def test_a_goaway_names_the_last_stream_with_no_error() -> None:
    data = goaway_frame(5, b"restarting")
    length = int.from_bytes(data[:3], "big")
    assert (data[3], data[4], data[5:9]) == (GOAWAY, 0, b"\0\0\0\0")
    assert length == len(data) - 9 == 8 + len(b"restarting")
    assert struct.unpack(">II", data[9:17]) == (5, 0)
    assert data[17:] == b"restarting"


def test_a_read_that_passes_whole_is_not_copied() -> None:
    streams = OpenStreams()
    inbound, outbound = ClientToServer(streams), ServerToClient(streams)
    inbound.feed(PREFACE)
    call = frame(HEADERS, 1, b"h" * 40, flags=0x4) + frame(DATA, 1, b"d" * 7, flags=END_STREAM)
    assert inbound.feed(call) is call
    answer = frame(HEADERS, 1, b"r" * 5, flags=0x4) + frame(DATA, 1, b"x" * 30)
    assert outbound.feed(answer) is answer


def test_a_client_frame_longer_than_advertised_is_refused_at_its_header() -> None:
    inbound = ClientToServer(OpenStreams())
    inbound.feed(PREFACE)
    with pytest.raises(FrameTooLarge):
        inbound.feed(b"\xff\xff\xff" + bytes((DATA, 0, 0, 0, 0, 1)))
    allowed = frame(DATA, 1, bytes(MAX_FRAME_SIZE))
    assert fed(ClientToServer(OpenStreams()), PREFACE + allowed, 4096) == PREFACE + allowed


@pytest.mark.parametrize("size", [1, 9, 4096])
def test_the_servers_settings_do_not_raise_the_frame_size_the_relay_takes(size: int) -> None:
    """gRPC's server says 4 MiB; the client is told what the relay takes."""
    outbound = ServerToClient(OpenStreams())
    settings = struct.pack(">HIHIHI", 0x4, 4 << 20, SETTINGS_MAX_FRAME_SIZE, 4 << 20, 0x6, 16384)
    after = frame(DATA, 1, b"x" * 20)
    lowered = struct.pack(
        ">HIHIHI", 0x4, 4 << 20, SETTINGS_MAX_FRAME_SIZE, MAX_FRAME_SIZE, 0x6, 16384
    )
    assert fed(outbound, frame(SETTINGS, 0, settings) + after, size) == (
        frame(SETTINGS, 0, lowered) + after
    )


def test_a_request_is_unfinished_until_its_end_stream_and_an_ended_stream_is_dropped() -> None:
    streams = OpenStreams()
    inbound, outbound = ClientToServer(streams), ServerToClient(streams)
    inbound.feed(PREFACE + frame(HEADERS, 1, b"h", flags=0x4) + frame(HEADERS, 3, b"h", flags=0x4))
    inbound.feed(frame(DATA, 1, b"whole", flags=END_STREAM) + frame(DATA, 3, b"part"))
    assert streams.unfinished == {3} and streams.ids == {1, 3}
    outbound.feed(frame(HEADERS, 3, b"r", flags=0x4))
    assert streams.answer_begun == {3}
    # The relay ends stream 3: the server's and the client's later frames on it are dropped.
    streams.ended.add(3)
    streams.closed(3)
    late = frame(DATA, 3, b"late")
    assert inbound.feed(late) == b"" and outbound.feed(late) == b""
    assert inbound.feed(frame(DATA, 1, b"more")) == frame(DATA, 1, b"more")


def test_the_relays_frames_wait_for_the_end_of_a_header_block() -> None:
    outbound = ServerToClient(OpenStreams())
    start = frame(HEADERS, 1, b"r" * 5)  # no END_HEADERS: a CONTINUATION follows
    assert outbound.feed(start) == start
    goaway = goaway_frame(1)
    assert outbound.insert(goaway) == b""
    rest = frame(0x9, 1, b"r", flags=0x4)
    assert outbound.feed(rest) == rest + goaway
