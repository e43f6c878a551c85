"""Request bytes to messages in our own code, so that bytes which are no message get INVALID_ARGUMENT
naming the field where it can be known (grpcio would answer INTERNAL, "Exception deserializing
request!", before any servicer ran).

protobuf's parser says only that a message failed to parse. To name the field, the bytes are walked
once more over the wire format (tag, wire type, payload) against the message's descriptor: the first
field whose payload runs past the end of its message, or a string field that is not UTF-8, is the one
named; nested messages are walked with their own descriptor ("verification.rule").
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)

_VARINT, _FIXED64, _LENGTH, _START_GROUP, _END_GROUP, _FIXED32 = range(6)


def decode(kind: type[M], data: bytes) -> M:
    """`data` parsed as a `kind`; ValueError "<field>: ..." (or "request: ...") when it is not one."""
    try:
        return kind.FromString(data)
    except (DecodeError, RuntimeError, ValueError):  # upb raises DecodeError; older parsers also these
        field, why = blame(kind.DESCRIPTOR, data) or ("request", "")
        name = kind.DESCRIPTOR.full_name
        raise ValueError(f"{field}: not a valid {name}{' (' + why + ')' if why else ''}") from None


def blame(descriptor: Descriptor, data: bytes, prefix: str = "") -> tuple[str, str] | None:
    """(the field path, why) of the first fault found in `data` as a `descriptor` message, or None."""
    position, end = 0, len(data)
    while position < end:
        tag_at = position
        tag, position = _varint(data, position)
        if tag is None:
            return (prefix.rstrip(".") or "request", "a truncated field tag")
        number, wire_type = tag >> 3, tag & 7
        field = descriptor.fields_by_number.get(number)
        name = prefix + field.name if field is not None else (prefix.rstrip(".") or "request")
        if number == 0:
            return name, f"field number 0 at byte {tag_at}"
        if wire_type == _VARINT:
            value, position = _varint(data, position)
            if value is None:
                return name, "a truncated number"
        elif wire_type in (_FIXED64, _FIXED32):
            position += 8 if wire_type == _FIXED64 else 4
            if position > end:
                return name, "a truncated number"
        elif wire_type == _LENGTH:
            length, position = _varint(data, position)
            if length is None or position + length > end:
                return name, "its length runs past the end of the message"
            payload = data[position : position + length]
            position += length
            if field is not None and (fault := _payload_fault(field, payload, name)) is not None:
                return fault
        elif wire_type == _START_GROUP:
            return name, "groups are not used by this API"
        else:  # an END_GROUP without its start, or wire types 6 and 7, which do not exist
            return name, f"wire type {wire_type} is not valid here"
    return None


def _payload_fault(field: FieldDescriptor, payload: bytes, name: str) -> tuple[str, str] | None:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError:
            return name, "not UTF-8"
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        return blame(field.message_type, payload, name + ".")
    elif _packable(field):  # packed repeated numbers: the varints must end within the payload
        position = 0
        while position < len(payload):
            if field.type in _FIXED:
                position += _FIXED[field.type]
                if position > len(payload):
                    return name, "a truncated number"
                continue
            value, position = _varint(payload, position)
            if value is None:
                return name, "a truncated number"
    return None


_FIXED = {
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_DOUBLE: 8,
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
    FieldDescriptor.TYPE_FLOAT: 4,
}


def _packable(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)
    is_repeated = repeated if isinstance(repeated, bool) else field.label == FieldDescriptor.LABEL_REPEATED
    return is_repeated and field.type not in (
        FieldDescriptor.TYPE_STRING,
        FieldDescriptor.TYPE_BYTES,
        FieldDescriptor.TYPE_MESSAGE,
        FieldDescriptor.TYPE_GROUP,
    )


def _varint(data: bytes, position: int) -> tuple[Any, int]:
    """(value, position after it), or (None, position) when it runs past the end or past 10 bytes."""
    value, shift = 0, 0
    for index in range(position, min(position + 10, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    return None, position
