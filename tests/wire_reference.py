"""An independent encoder of message content, built from protobuf's generated classes: the
reference that fedcore's one encoder (`fedcore.wire.codec.encode_value`, written by hand for
speed and to refuse what it must) and its size formulas are checked against."""
from __future__ import annotations

from typing import Any

from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.codec import MAX_DEPTH, WireError, tensor_wire


def to_value(obj: Any) -> pb.Value:
    """The protobuf Value for `obj`, built field by field by protobuf itself."""
    v = pb.Value()
    _fill(v, obj, 0)
    return v


def _fill(v: pb.Value, obj: Any, depth: int) -> None:
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
        parts = tensor_wire(obj)
        if parts is None:
            raise WireError(f"type {type(obj).__name__} is not allowed in message content")
        v.tensor.dtype, shape, data = parts
        v.tensor.shape.extend(shape)
        v.tensor.data = data.tobytes()


def reference_envelope(msg_type: str, sender: int, receivers, round_: int, timestamp: float,
                       content: Any, auth: str = "") -> bytes:
    """The whole Envelope serialized by protobuf (fields in number order)."""
    env = pb.Envelope(msg_type=msg_type, sender=sender, receivers=list(receivers),
                      round=round_, timestamp=timestamp, auth=auth)
    _fill(env.content, content, 0)
    return env.SerializeToString()
