"""Message content <-> protobuf, without pickle, and its exact wire size.

Content is a tree of an explicit set of types: None, bool, int, float, str,
bytes, torch.Tensor, and lists/tuples and str-keyed dicts of those. Anything
else is refused on the way out; anything malformed is refused on the way in.
`encoded_size` computes the exact number of bytes the protobuf encoding takes
without building it, so a simulation can count honest bytes for free.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Any

import torch

from fedcore.wire import fedcore_pb2 as pb

__all__ = [
    "WireError", "ALLOWED_DTYPES", "to_value", "encode_value", "from_value", "encoded_size",
    "envelope_size", "receiver_width", "encode_envelope", "decode_envelope",
]

MAX_DEPTH = 64

ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in ALLOWED_DTYPES.items()}


class WireError(ValueError):
    """Content that may not travel, or bytes that do not decode to valid content."""


# ---------------------------------------------------------------- encoding

def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8).numpy().tobytes()


def to_value(obj: Any) -> pb.Value:
    """Build the protobuf Value for `obj`; raise WireError for a type not allowed."""
    v = pb.Value()
    _fill(v, obj, 0)
    return v


def _fill(v: pb.Value, obj: Any, depth: int) -> None:
    """Write `obj` into `v` in place (no intermediate copies of tensor bytes)."""
    if depth > MAX_DEPTH:
        raise WireError(f"content nested deeper than {MAX_DEPTH} levels")
    if obj is None:
        v.none = True
    elif isinstance(obj, bool):
        v.b = obj
    elif isinstance(obj, int):
        v.i = obj
    elif isinstance(obj, float):
        v.f = obj
    elif isinstance(obj, str):
        v.s = obj
    elif isinstance(obj, (bytes, bytearray)):
        v.raw = bytes(obj)
    elif isinstance(obj, torch.Tensor):
        name = _DTYPE_NAMES.get(obj.dtype)
        if name is None:
            raise WireError(f"tensor dtype {obj.dtype} is not allowed on the wire")
        v.tensor.dtype = name
        v.tensor.shape.extend(obj.shape)
        v.tensor.data = _tensor_bytes(obj)
    elif isinstance(obj, (list, tuple)):
        v.list.SetInParent()
        for item in obj:
            _fill(v.list.items.add(), item, depth + 1)
    elif isinstance(obj, dict):
        v.map.SetInParent()
        for key, item in obj.items():
            if not isinstance(key, str):
                raise WireError(f"map keys must be str, got {type(key).__name__}")
            entry = v.map.entries.add()
            entry.key = key
            _fill(entry.value, item, depth + 1)
    else:
        raise WireError(f"type {type(obj).__name__} is not allowed in message content")


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_DOUBLE = struct.Struct("<d")


def _delimited(tag: bytes, pieces: list, body: list, size: int) -> int:
    """Append field `tag` holding `body` (pieces totalling `size` bytes); return bytes added."""
    head = tag + _uvarint(size)
    pieces.append(head)
    pieces.extend(body)
    return len(head) + size


def _encode(obj: Any, pieces: list, depth: int) -> int:
    """Append the pieces of `to_value(obj).SerializeToString()`; return their total length."""
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
        b = b"\x18" + _uvarint(_zigzag(obj) & ((1 << 64) - 1))
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
    if isinstance(obj, torch.Tensor):
        name = _DTYPE_NAMES.get(obj.dtype)
        if name is None:
            raise WireError(f"tensor dtype {obj.dtype} is not allowed on the wire")
        body: list = []
        size = _delimited(b"\x0a", body, [name.encode()], len(name))
        if obj.dim():
            dims = b"".join(_uvarint(d) for d in obj.shape)
            size += _delimited(b"\x12", body, [dims], len(dims))
        flat = obj.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        data = memoryview(flat.contiguous().view(torch.uint8).numpy())   # joined later: one copy
        if len(data):
            size += _delimited(b"\x1a", body, [data], len(data))
        return _delimited(b"\x3a", pieces, body, size)
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
    raise WireError(f"type {type(obj).__name__} is not allowed in message content")


def encode_value(obj: Any) -> bytes:
    """`to_value(obj).SerializeToString()`, byte for byte, with each tensor's bytes copied once
    (into the result) instead of three times (out of the tensor, into protobuf, out again)."""
    pieces: list = []
    _encode(obj, pieces, 0)
    return b"".join(pieces)


def from_value(v: pb.Value, _depth: int = 0) -> Any:
    """Rebuild content from a protobuf Value; raise WireError if it is malformed."""
    if _depth > MAX_DEPTH:
        raise WireError(f"content nested deeper than {MAX_DEPTH} levels")
    kind = v.WhichOneof("kind")
    if kind is None or kind == "none":
        return None
    if kind in ("b", "i", "f", "s", "raw"):
        return getattr(v, kind)
    if kind == "tensor":
        return _decode_tensor(v.tensor)
    if kind == "list":
        return [from_value(item, _depth + 1) for item in v.list.items]
    out: dict[str, Any] = {}
    for entry in v.map.entries:
        out[entry.key] = from_value(entry.value, _depth + 1)
    return out


def _decode_tensor(t: pb.Tensor) -> torch.Tensor:
    dtype = ALLOWED_DTYPES.get(t.dtype)
    if dtype is None:
        raise WireError(f"tensor dtype {t.dtype!r} is not allowed")
    shape = tuple(t.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"tensor shape {shape} has a negative dimension")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if expected != len(t.data):
        raise WireError(f"tensor of shape {shape} and dtype {t.dtype} needs {expected} bytes, got {len(t.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(t.data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------- sizes

def _varint_size(n: int) -> int:
    if n < 0:
        n += 1 << 64
    return (n.bit_length() + 6) // 7 or 1


def _zigzag(n: int) -> int:
    return (n << 1) ^ (n >> 63)


def _field(payload: int) -> int:
    """Bytes of a length-delimited field with a one-byte tag."""
    return payload + 2 if payload < 0x80 else 1 + _varint_size(payload) + payload


@functools.lru_cache(maxsize=4096)
def _tensor_size(dtype: torch.dtype, shape: torch.Size) -> int:
    """Encoded size of a tensor Value: a function of dtype and shape alone, so cached
    (a course sends the same few shapes millions of times)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise WireError(f"tensor dtype {dtype} is not allowed on the wire")
    size = _field(len(name))
    if len(shape):
        size += _field(sum(_varint_size(d) for d in shape))
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes:
        size += _field(nbytes)
    return _field(size)


def encoded_size(obj: Any) -> int:
    """Exact length of `to_value(obj).SerializeToString()`, computed without encoding."""
    # Tensors and maps of tensors are by far the most common content: test them first.
    if isinstance(obj, torch.Tensor):
        return _tensor_size(obj.dtype, obj.shape)
    if type(obj) is dict:
        total = 0
        for key, item in obj.items():
            if not isinstance(key, str):
                raise WireError(f"map keys must be str, got {type(key).__name__}")
            klen = len(key) if key.isascii() else len(key.encode("utf-8"))
            size = (_tensor_size(item.dtype, item.shape) if isinstance(item, torch.Tensor)
                    else encoded_size(item))
            entry = (_field(klen) if klen else 0) + _field(size)
            total += _field(entry)
        return _field(total)
    if obj is None or isinstance(obj, bool):
        return 2
    if isinstance(obj, int):
        return 1 + _varint_size(_zigzag(obj))
    if isinstance(obj, float):
        return 9
    if isinstance(obj, str):
        return _field(len(obj.encode("utf-8")))
    if isinstance(obj, (bytes, bytearray)):
        return _field(len(obj))
    if isinstance(obj, torch.Tensor):
        return _tensor_size(obj.dtype, obj.shape)
    if isinstance(obj, (list, tuple)):
        return _field(sum(_field(encoded_size(item)) for item in obj))
    if isinstance(obj, dict):
        total = 0
        for key, item in obj.items():
            if not isinstance(key, str):
                raise WireError(f"map keys must be str, got {type(key).__name__}")
            klen = len(key.encode("utf-8"))
            entry = (_field(klen) if klen else 0) + _field(encoded_size(item))
            total += _field(entry)
        return _field(total)
    raise WireError(f"type {type(obj).__name__} is not allowed in message content")


def receiver_width(receiver: int) -> int:
    """Bytes of one receiver id in an envelope's packed receiver list (its varint length)."""
    return _varint_size(_zigzag(receiver))


def envelope_size(msg_type: str, sender: int, receivers, round_: int, timestamp: float,
                  content: Any, auth: str = "", content_size: int | None = None) -> int:
    """Exact serialized size of the Envelope carrying this message.

    `content_size` (from `encoded_size(content)`) may be passed to avoid walking
    the content again when the same content goes to many receivers.
    """
    size = _field(len(msg_type.encode("utf-8"))) if msg_type else 0
    if sender:
        size += 1 + _varint_size(_zigzag(sender))
    if receivers:
        size += _field(sum(_varint_size(_zigzag(r)) for r in receivers))
    if round_:
        size += 1 + _varint_size(_zigzag(round_))
    if timestamp != 0.0:
        size += 9
    if auth:
        size += _field(len(auth.encode("utf-8")))
    if content_size is None:
        content_size = encoded_size(content)
    return size + _field(content_size)


def encode_envelope(msg_type: str, sender: int, receivers, round_: int, timestamp: float,
                    content: Any, auth: str = "") -> bytes:
    env = pb.Envelope(msg_type=msg_type, sender=sender, receivers=list(receivers),
                      round=round_, timestamp=timestamp, auth=auth)
    _fill(env.content, content, 0)
    return env.SerializeToString()


def decode_envelope(data: bytes) -> pb.Envelope:
    """Parse bytes into an Envelope; raise WireError on anything that is not one."""
    env = pb.Envelope()
    try:
        env.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError and, for some inputs, others
        raise WireError(f"bytes do not parse as a fedcore Envelope: {exc}") from None
    if not env.msg_type:
        raise WireError("envelope has no message type")
    return env
