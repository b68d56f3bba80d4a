"""Message content <-> protobuf bytes, without pickle and without any ML framework.

Content is a tree of an explicit set of types: None, bool, int, float, str,
bytes, tensors (of any registered form, see `fedcore.wire.tensor_forms`), and
lists/tuples and str-keyed dicts of those. Anything else is refused on the way
out; anything malformed is refused on the way in. Tensors are decoded into the
form the receiver asks for. Imports numpy and protobuf only.
"""
from __future__ import annotations

import math
import struct
from typing import Any

from fedcore.wire.tensor_forms import WIRE_DTYPES, get_form, wire_parts
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.errors import MAX_DEPTH, WireError

__all__ = ["WireError", "MAX_DEPTH", "encode_value", "encode_value_parts", "from_value", "decode_envelope", "envelope_parts",
           "content_field", "uvarint", "zigzag", "varint_size", "receiver_width"]

def uvarint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


_DOUBLE = struct.Struct("<d")


def receiver_width(receiver: int) -> int:
    """Bytes of one receiver id in an envelope's packed receiver list (its varint length)."""
    return varint_size(zigzag(receiver))


def timestamp_size(timestamp: float) -> int:
    """Bytes of an envelope's timestamp field: none for +0.0 (proto3's default, left out),
    9 for any other value, -0.0 included (its bits differ from the default's)."""
    return 9 if timestamp != 0.0 or math.copysign(1.0, timestamp) < 0 else 0


def varint_size(n: int) -> int:
    if n < 0:
        n += 1 << 64
    return (n.bit_length() + 6) // 7 or 1


def _delimited(tag: bytes, pieces: list, body: list, size: int) -> int:
    """Append field `tag` holding `body` (pieces totalling `size` bytes); return bytes added."""
    head = tag + uvarint(size)
    pieces.append(head)
    pieces.extend(body)
    return len(head) + size


def tensor_wire(obj: Any) -> tuple[str, tuple[int, ...], memoryview] | None:
    """(dtype, shape, bytes) of a tensor of any form, None for a non-tensor; WireError for a
    tensor whose dtype may not travel."""
    try:
        return wire_parts(obj)
    except ValueError as exc:
        raise WireError(str(exc)) from None


def _encode(obj: Any, pieces: list, depth: int) -> int:
    """Append the pieces of the encoded Value of `obj`; return their total length."""
    if depth > MAX_DEPTH:
        raise WireError(f"content nested deeper than {MAX_DEPTH} levels")
    if obj is None:
        pieces.append(b"\x08\x01")
        return 2
    if isinstance(obj, bool):
        pieces.append(b"\x10\x01" if obj else b"\x10\x00")
        return 2
    if isinstance(obj, int):
        if not -(1 << 63) <= obj < (1 << 63):
            raise WireError(f"integer {obj} does not fit in 64 bits")
        b = b"\x18" + uvarint(zigzag(obj) & ((1 << 64) - 1))
        pieces.append(b)
        return len(b)
    if isinstance(obj, float):
        pieces.append(b"\x21" + _DOUBLE.pack(obj))
        return 9
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _delimited(b"\x2a", pieces, [raw], len(raw))
    if isinstance(obj, (bytes, bytearray)):
        return _delimited(b"\x32", pieces, [bytes(obj)], len(obj))
    if isinstance(obj, (list, tuple)):
        body, size = [], 0
        for item in obj:
            sub: list = []
            size += _delimited(b"\x0a", body, sub, _encode(item, sub, depth + 1))
        return _delimited(b"\x42", pieces, body, size)
    if isinstance(obj, dict):
        body, size = [], 0
        for key, item in obj.items():
            if not isinstance(key, str):
                raise WireError(f"map keys must be str, got {type(key).__name__}")
            entry: list = []
            esize = 0
            if key:
                raw = key.encode("utf-8")
                esize += _delimited(b"\x0a", entry, [raw], len(raw))
            sub = []
            esize += _delimited(b"\x12", entry, sub, _encode(item, sub, depth + 1))
            size += _delimited(b"\x0a", body, entry, esize)
        return _delimited(b"\x4a", pieces, body, size)
    parts = tensor_wire(obj)
    if parts is None:
        raise WireError(f"type {type(obj).__name__} is not allowed in message content")
    name, shape, data = parts
    body = []
    size = _delimited(b"\x0a", body, [name.encode()], len(name))
    if shape:
        dims = b"".join(uvarint(d) for d in shape)
        size += _delimited(b"\x12", body, [dims], len(dims))
    if len(data):                                     # joined later: one copy
        size += _delimited(b"\x1a", body, [data], len(data))
    return _delimited(b"\x3a", pieces, body, size)


def encode_value(obj: Any) -> bytes:
    """The encoded protobuf Value of `obj`, byte for byte what protobuf would write, with each
    tensor's bytes copied once (into the result)."""
    return b"".join(encode_value_parts(obj))


def encode_value_parts(obj: Any) -> list:
    """The pieces whose concatenation is `encode_value(obj)`, a tensor's bytes as a view of the
    tensor (not copied): for content that is not written while its pieces are in use."""
    pieces: list = []
    _encode(obj, pieces, 0)
    return pieces


def from_value(v: pb.Value, form: str = "torch", _depth: int = 0) -> Any:
    """Rebuild content from a protobuf Value, tensors in `form`; WireError if it is malformed."""
    if _depth > MAX_DEPTH:
        raise WireError(f"content nested deeper than {MAX_DEPTH} levels")
    if not isinstance(v, pb.Value):   # the content of an envelope of 2 GiB or more (wire/large.py)
        from fedcore.wire.large import decode_raw_value
        return decode_raw_value(v, form)
    kind = v.WhichOneof("kind")
    if kind is None or kind == "none":
        return None
    if kind in ("b", "i", "f", "s", "raw"):
        return getattr(v, kind)
    if kind == "tensor":
        return decode_tensor(v.tensor, form)
    if kind == "list":
        return [from_value(item, form, _depth + 1) for item in v.list.items]
    out: dict[str, Any] = {}
    for entry in v.map.entries:
        out[entry.key] = from_value(entry.value, form, _depth + 1)
    return out


def decode_tensor(t: pb.Tensor, form: str = "torch") -> Any:
    itemsize = WIRE_DTYPES.get(t.dtype)
    if itemsize is None:
        raise WireError(f"tensor dtype {t.dtype!r} is not allowed")
    shape = tuple(t.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"tensor shape {shape} has a negative dimension")
    if math.prod(d for d in shape if d) >= 2 ** 62:   # empty, yet no library could lay it out
        raise WireError(f"tensor shape {shape} is too large")
    expected = math.prod(shape) * itemsize
    if expected != len(t.data):
        raise WireError(f"tensor of shape {shape} and dtype {t.dtype} needs {expected} bytes, got {len(t.data)}")
    try:
        return get_form(form).from_wire(t.dtype, shape, t.data)
    except (ValueError, RuntimeError, OverflowError) as exc:   # what a form's library refuses
        raise WireError(f"tensor of shape {shape} and dtype {t.dtype}: {exc}") from None


def envelope_parts(header: pb.Envelope, content: bytes) -> tuple[bytes, bytes, bytes]:
    """The bytes of `header` with `content` (an encoded Value) as its field 7, in three parts.

    Protobuf fields may come in any order, so header + tag + length + content
    parses as one Envelope; the content is never copied per receiver.
    """
    return header.SerializeToString(), content_field(content), content


def content_field(content: bytes | int) -> bytes:
    """The tag and length that make `content` (or that many bytes) an Envelope's field 7."""
    return b"\x3a" + uvarint(content if isinstance(content, int) else len(content))


def decode_envelope(data: bytes, consume: bool = False) -> pb.Envelope:
    """Parse bytes into an Envelope; raise WireError on anything that is not one. Envelopes of
    `LARGE_ENVELOPE` bytes or more (a large model) are read by wire/large.py: protobuf cannot
    parse 2 GiB, and below that it copies each tensor's bytes twice before they are decoded;
    `consume` lets their large tensors view `data` (a received bytearray, not read again)."""
    from fedcore.wire.large import LARGE_ENVELOPE, decode_large
    if len(data) >= LARGE_ENVELOPE:
        return decode_large(data, consume)
    env = pb.Envelope()
    try:
        env.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError and, for some inputs, others
        raise WireError(f"bytes do not parse as a fedcore Envelope: {exc}") from None
    if not env.msg_type:
        raise WireError("envelope has no message type")
    return env
