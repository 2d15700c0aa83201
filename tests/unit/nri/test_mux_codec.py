"""NRI's connection multiplexing: the 8-byte frame header, splitting long writes, joining
the frames of interleaved connections back into each connection's byte stream."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cri_shim.nri import mux, ttrpc
from cri_shim.nri.mux import MAX_FRAME_PAYLOAD, Frame, MuxCodec, MuxError


def test_the_two_connections_have_the_ids_of_the_contract() -> None:
    assert (mux.PLUGIN_SERVICE_CONN, mux.RUNTIME_SERVICE_CONN) == (1, 2)
    assert MAX_FRAME_PAYLOAD == 10 + 4 * 1024 * 1024


def test_header_is_conn_id_and_length_big_endian() -> None:
    assert mux.encode(2, b"abc") == b"\x00\x00\x00\x02\x00\x00\x00\x03abc"


def test_an_empty_write_is_one_empty_frame() -> None:
    assert mux.encode(1, b"") == b"\x00\x00\x00\x01\x00\x00\x00\x00"
    assert MuxCodec().feed(mux.encode(1, b"")) == [Frame(1, b"")]


def test_a_long_write_is_split_into_frames_of_the_largest_payload() -> None:
    data = bytes(range(256)) * ((2 * MAX_FRAME_PAYLOAD + 100) // 256 + 1)
    frames = MuxCodec().feed(mux.encode(1, data))
    assert [len(f.payload) for f in frames] == [
        MAX_FRAME_PAYLOAD,
        MAX_FRAME_PAYLOAD,
        len(data) - 2 * MAX_FRAME_PAYLOAD,
    ]
    assert b"".join(f.payload for f in frames) == data


def test_a_whole_ttrpc_message_of_the_largest_size_fits_one_frame() -> None:
    message = ttrpc.encode_message(1, ttrpc.MessageType.REQUEST, b"\0" * ttrpc.MAX_MESSAGE)
    assert len(MuxCodec().feed(mux.encode(2, message))) == 1


def test_a_frame_claiming_more_is_refused() -> None:
    header = mux.HEADER.pack(1, MAX_FRAME_PAYLOAD + 1)
    with pytest.raises(MuxError, match="larger than"):
        MuxCodec().feed(header)


def test_an_id_past_32_bits_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bits"):
        mux.encode(1 << 32, b"x")


@given(
    st.lists(st.tuples(st.sampled_from([0, 1, 2, 7]), st.binary(max_size=50)), max_size=10),
    st.lists(st.integers(1, 30), max_size=20),
)
def test_interleaved_connections_keep_their_byte_streams(
    writes: list[tuple[int, bytes]], cuts: list[int]
) -> None:
    trunk = b"".join(mux.encode(c, d) for c, d in writes)
    codec = MuxCodec()
    frames: list[Frame] = []
    offset = 0
    for cut in cuts:
        frames += codec.feed(trunk[offset : offset + cut])
        offset += cut
    frames += codec.feed(trunk[offset:])
    assert frames == [Frame(c, d) for c, d in writes]
    assert codec.pending == 0


@given(st.lists(st.binary(max_size=40), max_size=6), st.integers(1, 17))
def test_ttrpc_messages_survive_any_framing(payloads: list[bytes], chunk: int) -> None:
    """A logical connection is a byte stream: ttrpc messages cut across frames at any
    place come out whole."""
    stream = b"".join(
        ttrpc.encode_message(2 * i + 1, ttrpc.MessageType.RESPONSE, p)
        for i, p in enumerate(payloads)
    )
    trunk = b"".join(mux.encode(2, stream[i : i + chunk]) for i in range(0, len(stream), chunk))
    messages = ttrpc.MessageCodec()
    got = []
    for frame in MuxCodec().feed(trunk):
        got += messages.feed(frame.payload)
    assert [m.payload for m in got if isinstance(m, ttrpc.Message)] == payloads
