"""Message content <-> protobuf, without pickle, and its exact wire size.

Content is a tree of an explicit set of types: None, bool, int, float, str,
bytes, tensors, and lists/tuples and str-keyed dicts of those. Anything
else is refused on the way out; anything malformed is refused on the way in.
The encoding and decoding themselves live in `fedcore.wire.codec` (no torch
there, for clients without it); this module adds torch's side: decoding into
torch tensors by default, one receiver's envelope, and exact sizes.
`encoded_size` computes the exact number of bytes the protobuf encoding takes
without building it, so a simulation can count honest bytes for free.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.codec import (WireError, decode_envelope, encode_value, envelope_parts, from_value,
                                receiver_width, tensor_wire, timestamp_size, varint_size, zigzag)

__all__ = [
    "WireError", "ALLOWED_DTYPES", "encode_value", "from_value", "encoded_size",
    "envelope_size", "receiver_width", "encode_envelope", "decode_envelope",
]

ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in ALLOWED_DTYPES.items()}


# ---------------------------------------------------------------- encoding

# ---------------------------------------------------------------- sizes

def _field(payload: int) -> int:
    """Bytes of a length-delimited field with a one-byte tag."""
    return payload + 2 if payload < 0x80 else 1 + varint_size(payload) + payload


@functools.lru_cache(maxsize=4096)
def _tensor_size(dtype: torch.dtype, shape: torch.Size) -> int:
    """Encoded size of a tensor Value: a function of dtype and shape alone, so cached
    (a course sends the same few shapes millions of times)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise WireError(f"tensor dtype {dtype} is not allowed on the wire")
    return _wire_tensor_size(name, tuple(shape), math.prod(shape) * dtype.itemsize)


def _wire_tensor_size(name: str, shape: tuple[int, ...], nbytes: int) -> int:
    size = _field(len(name))
    if len(shape):
        size += _field(sum(varint_size(d) for d in shape))
    if nbytes:
        size += _field(nbytes)
    return _field(size)


def encoded_size(obj: Any) -> int:
    """Exact length of `encode_value(obj)`, computed without encoding."""
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
        return 1 + varint_size(zigzag(obj))
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
    parts = tensor_wire(obj)   # a tensor of another form (numpy, ...)
    if parts is None:
        raise WireError(f"type {type(obj).__name__} is not allowed in message content")
    name, shape, data = parts
    return _wire_tensor_size(name, shape, len(data))


def envelope_size(msg_type: str, sender: int, receivers, round_: int, timestamp: float,
                  content: Any, auth: str = "", content_size: int | None = None) -> int:
    """Exact serialized size of the Envelope carrying this message.

    `content_size` (from `encoded_size(content)`) may be passed to avoid walking
    the content again when the same content goes to many receivers.
    """
    size = _field(len(msg_type.encode("utf-8"))) if msg_type else 0
    if sender:
        size += 1 + varint_size(zigzag(sender))
    if receivers:
        size += _field(sum(varint_size(zigzag(r)) for r in receivers))
    if round_:
        size += 1 + varint_size(zigzag(round_))
    size += timestamp_size(timestamp)
    if auth:
        size += _field(len(auth.encode("utf-8")))
    if content_size is None:
        content_size = encoded_size(content)
    return size + _field(content_size)


def encode_envelope(msg_type: str, sender: int, receivers, round_: int, timestamp: float,
                    content: Any, auth: str = "") -> bytes:
    """One receiver's envelope: the header and the content's encoding (`encode_value`)."""
    header = pb.Envelope(msg_type=msg_type, sender=sender, receivers=list(receivers),
                         round=round_, timestamp=timestamp, auth=auth)
    return b"".join(envelope_parts(header, encode_value(content)))
