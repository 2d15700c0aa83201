"""ttrpc framing and envelopes: byte layouts of the wire contract, any split of the byte
stream, the 4 MiB limit, and the caller's bookkeeping of stream IDs and answers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cri_shim.nri import ttrpc
from cri_shim.nri.api import ttrpc_pb2
from cri_shim.nri.ttrpc import (
    MAX_MESSAGE,
    CallError,
    Calls,
    Code,
    Message,
    MessageCodec,
    MessageType,
    Oversized,
    TtrpcError,
    decode_request,
    encode_message,
    encode_response,
)


def test_header_is_length_stream_type_flags_big_endian() -> None:
    data = encode_message(0x01020304, MessageType.RESPONSE, b"xyz", flags=ttrpc.FLAG_NO_DATA)
    assert data == b"\x00\x00\x00\x03\x01\x02\x03\x04\x02\x04xyz"


def test_request_envelope_has_the_field_numbers_of_the_contract() -> None:
    stream_id, data = Calls().start("svc", "M", b"\x01", timeout_ns=5)
    assert stream_id == 1
    # service=1 (string), method=2 (string), payload=3 (bytes), timeout_nano=4 (varint)
    body = b"\x0a\x03svc" + b"\x12\x01M" + b"\x1a\x01\x01" + b"\x20\x05"
    assert data == len(body).to_bytes(4, "big") + b"\x00\x00\x00\x01\x01\x00" + body


def test_response_envelope_has_the_field_numbers_of_the_contract() -> None:
    data = encode_response(7, b"ok", Code.NOT_FOUND, "gone")
    # status=1 {code=1, message=2}, payload=2
    body = b"\x0a\x08" + b"\x08\x05" + b"\x12\x04gone" + b"\x12\x02ok"
    assert data == len(body).to_bytes(4, "big") + b"\x00\x00\x00\x07\x02\x00" + body


def test_metadata_and_timeout_reach_the_server() -> None:
    envelope = ttrpc_pb2.Request(service="s", method="m", payload=b"p", timeout_nano=2_000)
    envelope.metadata.add(key="k", value="v")
    raw = encode_message(3, MessageType.REQUEST, envelope.SerializeToString())
    [message] = MessageCodec().feed(raw)
    assert isinstance(message, Message)
    request = decode_request(message)
    assert (request.stream_id, request.service, request.method) == (3, "s", "m")
    assert (request.payload, request.timeout_ns, request.metadata) == (b"p", 2_000, (("k", "v"),))


def test_a_request_that_does_not_decode_is_a_protocol_error() -> None:
    with pytest.raises(TtrpcError, match="stream 5"):
        decode_request(Message(5, MessageType.REQUEST, 0, b"\xff\xff\xff"))


_messages = st.lists(
    st.tuples(
        st.integers(0, ttrpc.MAX_STREAM_ID),
        st.sampled_from(list(MessageType)),
        st.integers(0, 255),
        st.binary(max_size=64),
    ),
    max_size=8,
)


@given(_messages, st.lists(st.integers(1, 40), max_size=20))
def test_any_split_of_the_stream_gives_the_same_messages(
    messages: list[tuple[int, MessageType, int, bytes]], cuts: list[int]
) -> None:
    stream = b"".join(encode_message(s, t, p, f) for s, t, f, p in messages)
    codec = MessageCodec()
    got: list[ttrpc.Event] = []
    offset = 0
    for cut in cuts:
        got += codec.feed(stream[offset : offset + cut])
        offset += cut
    got += codec.feed(stream[offset:])
    assert got == [Message(s, t, f, p) for s, t, f, p in messages]
    assert codec.pending == 0


def test_a_partial_message_waits_for_the_rest() -> None:
    codec = MessageCodec()
    data = encode_message(1, MessageType.REQUEST, b"abcdef")
    assert codec.feed(data[:9]) == []
    assert codec.feed(data[9:12]) == []
    assert codec.pending == 12
    assert codec.feed(data[12:]) == [Message(1, MessageType.REQUEST, 0, b"abcdef")]


def test_a_message_past_4_mib_is_skipped_and_the_next_one_read() -> None:
    codec = MessageCodec()
    too_long = MAX_MESSAGE + 1
    header = ttrpc.HEADER.pack(too_long, 9, MessageType.REQUEST, 0)
    after = encode_message(11, MessageType.REQUEST, b"next")
    assert codec.feed(header + b"x" * 1000) == [Oversized(9, MessageType.REQUEST, too_long)]
    assert codec.pending == 0  # skipped bytes are not kept
    assert codec.feed(b"x" * (too_long - 2000)) == []
    assert codec.feed(b"x" * 1000 + after) == [Message(11, MessageType.REQUEST, 0, b"next")]


def test_nothing_past_4_mib_is_sent() -> None:
    with pytest.raises(ValueError, match="larger than"):
        encode_message(1, MessageType.REQUEST, b"\0" * (MAX_MESSAGE + 1))
    assert len(encode_message(1, MessageType.REQUEST, b"\0" * MAX_MESSAGE)) == MAX_MESSAGE + 10


def test_a_response_too_large_becomes_resource_exhausted() -> None:
    data = encode_response(1, b"\0" * MAX_MESSAGE)
    [message] = MessageCodec().feed(data)
    assert isinstance(message, Message)
    with pytest.raises(CallError) as failed:
        ttrpc.decode_response(message)
    assert failed.value.code == Code.RESOURCE_EXHAUSTED


def test_the_caller_uses_odd_stream_ids_counting_up() -> None:
    calls = Calls()
    ids = [calls.start("s", "m", b"")[0] for _ in range(4)]
    assert ids == [1, 3, 5, 7]
    assert calls.outstanding == {1: "s/m", 3: "s/m", 5: "s/m", 7: "s/m"}


def test_an_answer_is_matched_to_its_call_once() -> None:
    calls = Calls()
    first, _ = calls.start("s", "A", b"")
    second, _ = calls.start("s", "B", b"")
    [answer] = MessageCodec().feed(encode_response(second, b"resp"))
    assert calls.receive(answer) == (second, b"resp")
    assert calls.receive(answer) is None  # a repeated answer answers nothing
    assert calls.outstanding == {first: "s/A"}


def test_a_failed_call_carries_code_and_message() -> None:
    calls = Calls()
    stream_id, _ = calls.start("s", "m", b"")
    [answer] = MessageCodec().feed(
        encode_response(stream_id, code=Code.UNIMPLEMENTED, message="no")
    )
    result = calls.receive(answer)
    assert result is not None and isinstance(result[1], CallError)
    assert (result[1].code, result[1].message) == (Code.UNIMPLEMENTED, "no")
    assert str(result[1]) == "UNIMPLEMENTED: no"


def test_an_unknown_status_code_is_kept_as_a_number() -> None:
    assert CallError(99, "odd").code == 99
    assert str(CallError(99, "odd")) == "99: odd"


def test_a_late_answer_to_an_abandoned_call_is_dropped() -> None:
    calls = Calls()
    stream_id, _ = calls.start("s", "m", b"")
    calls.abandon(stream_id)
    [answer] = MessageCodec().feed(encode_response(stream_id, b"late"))
    assert calls.receive(answer) is None
    assert calls.outstanding == {}


def test_an_oversized_answer_fails_its_call() -> None:
    calls = Calls()
    stream_id, _ = calls.start("s", "m", b"")
    result = calls.receive(Oversized(stream_id, MessageType.RESPONSE, MAX_MESSAGE + 1))
    assert result is not None and isinstance(result[1], CallError)
    assert result[1].code == Code.RESOURCE_EXHAUSTED
    assert calls.receive(Oversized(99, MessageType.RESPONSE, MAX_MESSAGE + 1)) is None


def test_a_request_where_an_answer_belongs_is_a_protocol_error() -> None:
    calls = Calls()
    calls.start("s", "m", b"")
    with pytest.raises(TtrpcError, match="not a response"):
        calls.receive(Message(1, MessageType.REQUEST, 0, b""))


def test_stream_ids_run_out_at_32_bits() -> None:
    calls = Calls()
    calls._next = ttrpc.MAX_STREAM_ID  # the last odd 32-bit number
    assert calls.start("s", "m", b"")[0] == ttrpc.MAX_STREAM_ID
    with pytest.raises(TtrpcError, match="used up"):
        calls.start("s", "m", b"")
