"""How many values an encoded Envelope holds, counted without decoding it.

Decoding costs more than the bytes sent: protobuf builds an object of some
100 bytes for a 2-byte empty `Value`, and Python builds another on top, so a
message of a few megabytes can decode into gigabytes. `check_values` walks the
wire format itself (tags and lengths only; a tensor's data, a string or raw
bytes is skipped in one step, never copied) and refuses a message holding more
values than the course can need, before anything is built. A value here is
one field of the encoding or one entry of a packed list (a tensor's shape, an
envelope's receivers), so the walk's own cost is bounded by the same limit.
"""
from __future__ import annotations

from fedcore.wire.errors import MAX_DEPTH, WireError

__all__ = ["check_values", "values_bound"]

_ENVELOPE, _VALUE, _TENSOR, _LIST, _MAP, _ENTRY = range(6)
# (message, field number) -> the message that field holds (proto/fedcore.proto)
_NESTED = {(_ENVELOPE, 7): _VALUE, (_VALUE, 7): _TENSOR, (_VALUE, 8): _LIST, (_VALUE, 9): _MAP,
           (_LIST, 1): _VALUE, (_MAP, 1): _ENTRY, (_ENTRY, 2): _VALUE}
_PACKED = {(_ENVELOPE, 3), (_TENSOR, 2)}   # repeated numbers: receivers, a tensor's shape
_LOW = bytes(range(0x80))                  # the bytes that end a varint
_TOO_MANY = "message holds more values than this course's messages can (distribute.max_message_values)"


def values_bound(tensors: int, clients: int) -> int:
    """Values a course's message may hold: 64 per tensor of its model (an update carrying
    several maps over the model, each tensor costing about ten), 32 per client (a secure
    aggregation's per-peer lists) and 4096 for the rest (metrics, names, counts)."""
    return 64 * tensors + 32 * clients + 4096


def check_values(data: bytes, limit: int) -> int:
    """The number of values the Envelope `data` holds; WireError as soon as it exceeds
    `limit` (or the bytes are not a well-formed encoding)."""
    left = _walk(memoryview(data), 0, len(data), _ENVELOPE, 0, limit)
    if left < 0:
        raise WireError(_TOO_MANY)
    return limit - left


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise WireError("malformed encoding: a varint runs past its field")


def _walk(buf: memoryview, pos: int, end: int, kind: int, depth: int, left: int) -> int:
    """Walk the fields of one message of `kind` in buf[pos:end]; returns the values left."""
    if depth > 2 * MAX_DEPTH + 2:
        raise WireError(f"content nested deeper than {MAX_DEPTH} levels")
    while pos < end:
        left -= 1
        if left < 0:
            raise WireError(_TOO_MANY)
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos, end)
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            stop = pos + n
            if stop > end:
                raise WireError("malformed encoding: a field runs past its message")
            nested = _NESTED.get((kind, field))
            if nested is not None:
                left = _walk(buf, pos, stop, nested, depth + 1, left)
            elif (kind, field) in _PACKED:   # one value per varint: the bytes below 0x80
                left -= n - len(bytes(buf[pos:stop]).translate(None, _LOW))
            pos = stop
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise WireError(f"malformed encoding: wire type {wire}")
    if pos != end:
        raise WireError("malformed encoding: a field runs past its message")
    return left
