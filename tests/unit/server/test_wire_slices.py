"""server/wire.py: a large request parsed slice by slice is the message protobuf parses
whole, and the loop gets the interpreter back between slices."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from cri_shim.api.v1 import api_pb2
from cri_shim.server import wire
from cri_shim.server.wire import LARGE_REQUEST, LargeRequest, deserializer, parse_in_slices

text = st.text(max_size=40)
pairs = st.lists(st.tuples(text, st.binary(max_size=40)), max_size=30)


@st.composite
def create_requests(draw: st.DrawFn) -> api_pb2.CreateContainerRequest:
    config = api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(
            name=draw(text), attempt=draw(st.integers(0, 2**32 - 1))
        ),
        image=api_pb2.ImageSpec(image=draw(text)),
        args=draw(st.lists(text, max_size=50)),
        envs=[api_pb2.KeyValue(key=k, value=v) for k, v in draw(pairs)],
        labels=dict(draw(st.lists(st.tuples(text, text), max_size=10))),
        mounts=[
            api_pb2.Mount(container_path=p, host_path=h, readonly=r)
            for p, h, r in draw(st.lists(st.tuples(text, text, st.booleans()), max_size=10))
        ],
        tty=draw(st.booleans()),
    )
    if draw(st.booleans()):
        config.linux.resources.memory_limit_in_bytes = draw(st.integers(0, 2**62))
        config.linux.security_context.run_as_user.value = draw(st.integers(0, 2**32))
    return api_pb2.CreateContainerRequest(
        pod_sandbox_id=draw(text),
        config=config,
        sandbox_config=api_pb2.PodSandboxConfig(hostname=draw(text)),
    )


@settings(max_examples=200, deadline=None)
@given(request=create_requests(), slice_size=st.integers(1, 300))
def test_sliced_parsing_is_whole_parsing(
    request: api_pb2.CreateContainerRequest, slice_size: int
) -> None:
    # Tiny slices make every field boundary and nested message a slice boundary.
    saved = wire.SLICE
    wire.SLICE = slice_size
    try:
        parsed = parse_in_slices(api_pb2.CreateContainerRequest, request.SerializeToString())
    finally:
        wire.SLICE = saved
    assert parsed == request


@pytest.fixture
def sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each slice merged from now on."""
    merged: list[int] = []
    merge = wire._merge_slice

    def counting(message: object, data: memoryview) -> None:
        merged.append(len(data))
        merge(message, data)  # type: ignore[arg-type]

    monkeypatch.setattr(wire, "_merge_slice", counting)
    return merged


def test_a_large_request_is_merged_a_slice_at_a_time(sizes: list[int]) -> None:
    config = api_pb2.ContainerConfig(args=["a" * 100] * 20_000)  # ~2 MiB, all inside config
    request = api_pb2.CreateContainerRequest(pod_sandbox_id="p", config=config)
    assert parse_in_slices(api_pb2.CreateContainerRequest, request.SerializeToString()) == request
    assert len(sizes) >= 8
    assert max(sizes) < wire.SLICE + 200


def test_only_large_requests_are_left_for_later() -> None:
    small = api_pb2.VersionRequest(version="v1")
    parse = deserializer(api_pb2.VersionRequest)
    assert parse(small.SerializeToString()) == small
    big = api_pb2.ExecSyncRequest(container_id="c", cmd=["x" * 1000] * 300)
    data = big.SerializeToString()
    assert len(data) > LARGE_REQUEST
    deferred = deserializer(api_pb2.ExecSyncRequest)(data)
    assert isinstance(deferred, LargeRequest)
    assert deferred.parse() == big


@pytest.mark.parametrize(
    "data",
    [
        # config (field 2) says 300 KiB and carries 10 bytes
        b"\x12\x80\xa6\x12" + b"x" * 10,
        # a varint that never ends
        b"\x08" + b"\xff" * 20,
        # a fixed64 field cut short
        b"\x09\x01\x02",
    ],
)
def test_bytes_that_are_no_request_are_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        parse_in_slices(api_pb2.CreateContainerRequest, data)


GROUP = b"\xa3\x06\xa4\x06"  # field 100: start group, end group (empty)


@pytest.mark.parametrize(
    "data",
    [
        # before everything else: the rest was once parsed in one piece
        GROUP + api_pb2.CreateContainerRequest(pod_sandbox_id="p").SerializeToString(),
        # inside config, which is merged into in slices of its own
        b"\x12\xe8\xa7\x12"  # config: 300,008 bytes
        + GROUP
        + api_pb2.ContainerConfig(log_path="x" * 300_000).SerializeToString(),
    ],
)
def test_a_group_is_refused_wherever_it_is(data: bytes) -> None:
    with pytest.raises(DecodeError, match="is a group"):
        parse_in_slices(api_pb2.CreateContainerRequest, data)


def test_one_huge_element_of_a_repeated_field_is_merged_in_slices(sizes: list[int]) -> None:
    mapping = api_pb2.IDMapping(host_id=1, container_id=1, length=1)
    mount = api_pb2.Mount(container_path="/m", uidMappings=[mapping] * 200_000)  # ~2 MiB
    config = api_pb2.ContainerConfig(mounts=[api_pb2.Mount(container_path="/a"), mount])
    request = api_pb2.CreateContainerRequest(pod_sandbox_id="p", config=config)
    assert parse_in_slices(api_pb2.CreateContainerRequest, request.SerializeToString()) == request
    assert max(sizes) < wire.SLICE + 200
