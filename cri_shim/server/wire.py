"""Requests of many megabytes parsed without holding the event loop.

gRPC parses a request on the event loop before the handler runs, and protobuf's parser
holds the interpreter for the whole message: a 12 MiB CreateContainer is 50-120 ms during
which no other RPC is answered. So every method's deserializer parses a small request at
once and hands a large one (over `LARGE_REQUEST` bytes) to its handler unparsed, as a
`LargeRequest`; the rpc wrapper (server/rpc.py) parses that in a worker thread, slice by
slice, so that the loop gets the interpreter back between slices.

Slicing relies on protobuf's own rule that parsing two serialized fragments one after the
other into the same message is the same as parsing their concatenation: the message's
fields are walked on the wire, consecutive fields are merged a few hundred KiB at a time,
and a sub-message field bigger than a slice (CreateContainer's `config`, or one element of
a repeated message field such as a mount with a million ID mappings) is itself merged
into in slices. Repeated fields (argv, environment, mounts) are one wire field per
element, so they slice naturally.

Groups (wire types 3 and 4) are refused: no CRI message has one, and the parser takes a
group, however long, in one piece (a 14 MiB request behind a leading empty group was
parsed in one 130 ms slice).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

LARGE_REQUEST = 256 * 1024
# About a millisecond of parsing: the longest the loop waits for the interpreter.
SLICE = 256 * 1024

_VARINT, _FIXED64, _LENGTH_DELIMITED, _START_GROUP, _END_GROUP, _FIXED32 = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class LargeRequest:
    """A request too large to parse on the event loop, as it came off the wire."""

    message_class: type[Message]
    data: bytes

    def parse(self) -> Message:
        """The message (call it off the event loop); DecodeError for bytes that are not
        one."""
        return parse_in_slices(self.message_class, self.data)


def deserializer(message_class: type[Message]) -> Callable[[bytes], Any]:
    """The request deserializer of a method whose requests are `message_class`."""
    parse = message_class.FromString

    def deserialize(data: bytes) -> Any:
        if len(data) > LARGE_REQUEST:
            return LargeRequest(message_class, data)
        return parse(data)

    return deserialize


def parse_in_slices(message_class: type[Message], data: bytes) -> Message:
    message = message_class()
    _merge(message, memoryview(data))
    return message


def _merge(message: Message, data: memoryview) -> None:
    fields = message.DESCRIPTOR.fields_by_number
    pending = 0  # the first byte not merged into `message` yet
    position = 0
    end = len(data)
    while position < end:
        field_start = position
        # One-byte keys and lengths are the common case: read them inline.
        key = data[position]
        if key < 0x80:
            position += 1
        else:
            key, position = _varint(data, position)
        wire_type = key & 7
        if wire_type == _LENGTH_DELIMITED:
            length = data[position] if position < end else 0x80
            if length < 0x80:
                position += 1
            else:
                length, position = _varint(data, position)
            payload = position
            position += length
            if length > SLICE and position <= end:
                target = _sub_message(message, fields.get(key >> 3))
                if target is not None:
                    _merge_slice(message, data[pending:field_start])
                    _merge(target(), data[payload:position])
                    pending = position
                    continue
        elif wire_type == _VARINT:
            _, position = _varint(data, position)
        elif wire_type == _FIXED64:
            position += 8
        elif wire_type == _FIXED32:
            position += 4
        elif wire_type in (_START_GROUP, _END_GROUP):
            raise DecodeError(
                f"field {key >> 3} of {message.DESCRIPTOR.name} is a group (wire type "
                f"{wire_type}), which no CRI message has"
            )
        else:
            raise DecodeError(
                f"field {key >> 3} of {message.DESCRIPTOR.name} has wire type {wire_type}, "
                "which protobuf does not have"
            )
        if position - pending >= SLICE:
            _merge_slice(message, data[pending:position])
            pending = position
    if position > end:
        raise DecodeError(f"truncated {message.DESCRIPTOR.name}: a field runs past the end")
    _merge_slice(message, data[pending:])


def _merge_slice(message: Message, data: memoryview) -> None:
    if len(data):
        message.MergeFromString(bytes(data))


def _sub_message(message: Message, field: Any) -> Callable[[], Message] | None:
    """What a message field's next occurrence on the wire merges into: the sub-message of
    a singular field, a new element of a repeated one; None for any other field (a map
    entry holds strings here, and an unknown field's bytes are only copied)."""
    if field is None or field.type != FieldDescriptor.TYPE_MESSAGE:
        return None
    if not field.is_repeated:
        return lambda: getattr(message, field.name)
    if field.message_type.GetOptions().map_entry:
        return None
    return getattr(message, field.name).add  # type: ignore[no-any-return]


def _varint(data: memoryview, position: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise DecodeError("a varint runs past the end of the request")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
