"""Large envelopes (a model's), decoded without protobuf.

protobuf refuses to parse a message of 2 GiB or more ("wire format was corrupt"), yet
a model of a few gigabytes is one such message; below that, protobuf's parse and then
the tensor decoder each copy a tensor's bytes. `decode_large` reads the same wire
format (proto/fedcore.proto) field by field over a memoryview: the header fields as
protobuf would give them, and the content as a `RawValue` span that `from_value`
decodes, each tensor copied once out of the received bytes. Anything malformed is a
WireError, as with protobuf. `decode_envelope` sends envelopes of `LARGE_ENVELOPE`
(16 MiB) or more here; every smaller message still goes through protobuf as before.

Where the caller gives the received bytes up (`consume`: a reassembled message's
bytearray or a spooled message's mapping (wire/spooled.py), read once), torch tensors of `IN_PLACE_BYTES` or more are not copied at all: each becomes a view of the received bytes, moved back by at
most 7 bytes within them (over fields already read) to sit at an address its dtype
allows. The message's buffer is then the update's memory, let go with its last view, so
a server holds one copy of an update, not two (`_Placer`).
"""
from __future__ import annotations

import ctypes
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from fedcore.wire.tensor_forms import WIRE_DTYPES, get_form
from fedcore.wire.census import _varint
from fedcore.wire.errors import MAX_DEPTH, WireError
from fedcore.wire.spooled import release

__all__ = ["PROTOBUF_LIMIT", "LARGE_ENVELOPE", "IN_PLACE_BYTES", "RawValue", "LargeEnvelope", "decode_large", "decode_raw_value"]

PROTOBUF_LIMIT = 2 ** 31 - 1   # protobuf parses messages below this size
LARGE_ENVELOPE = 16 * 2 ** 20  # envelopes this large are read here (one copy of each tensor)
IN_PLACE_BYTES = 2 ** 20       # tensors this large, received into a bytearray, are views of it
MOVE_PIECE = 2 ** 22           # bytes moved at a time to align a tensor in place
_DOUBLE = struct.Struct("<d")


class _Placer:
    """Turns spans of one writable received buffer into torch tensors without a copy.

    Decoding reads the buffer forward, so when a tensor's data are reached every byte
    before them has been read: the data may move back onto them to be aligned. A span
    that would land on an earlier view (`mark`) is copied instead."""

    def __init__(self, owner: memoryview) -> None:
        import torch
        self.bytes = torch.frombuffer(owner, dtype=torch.uint8)
        self.address = self.bytes.data_ptr()
        self.mark = 0     # where the last view ends: nothing before it may be written

    def tensor(self, dtype: str, shape: tuple[int, ...], start: int, n: int, itemsize: int):
        """The tensor whose data are buf[start:start + n], viewing the buffer; None to copy."""
        import torch
        dst = start - (self.address + start) % itemsize
        if dst < self.mark:
            return None
        for at in range(0, n if dst != start else 0, MOVE_PIECE):   # a piece at a time: a spooled
            k = min(MOVE_PIECE, n - at)                         # message's pages go back as moved
            ctypes.memmove(self.address + dst + at, self.address + start + at, k)
            release(self.bytes[dst + at:dst + at + k])
        self.mark = dst + n
        return self.bytes[dst:dst + n].view(getattr(torch, dtype)).view(shape)


@dataclass
class RawValue:
    """An encoded Value not yet decoded: buf[start:end] (`placer`: tensors may view buf)."""
    buf: memoryview
    start: int
    end: int
    placer: _Placer | None = None


@dataclass
class LargeEnvelope:
    """The header fields of an Envelope (as protobuf names them) and its content, encoded."""
    msg_type: str = ""
    sender: int = 0
    receivers: list[int] = field(default_factory=list)
    round: int = 0
    timestamp: float = 0.0
    auth: str = ""
    content: RawValue | None = None


def _unzigzag(n: int) -> int:
    n &= (1 << 64) - 1
    return (n >> 1) ^ -(n & 1)


def _fields(buf: memoryview, pos: int, end: int):
    """(field number, wire type, value or (start, stop) span) of each field in buf[pos:end]."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise WireError("malformed encoding: a field runs past its message")
            value, pos = (pos, pos + n), pos + n
        elif wire == 1:
            if pos + 8 > end:
                raise WireError("malformed encoding: a field runs past its message")
            value, pos = bytes(buf[pos:pos + 8]), pos + 8
        elif wire == 5:
            value, pos = None, pos + 4
        else:
            raise WireError(f"malformed encoding: wire type {wire}")
        yield number, wire, value
    if pos != end:
        raise WireError("malformed encoding: a field runs past its message")


def _text(buf: memoryview, span: tuple[int, int]) -> str:
    try:
        return bytes(buf[span[0]:span[1]]).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("malformed encoding: a string is not UTF-8") from None


def decode_large(data: bytes | bytearray | memoryview, consume: bool = False) -> LargeEnvelope:
    """The Envelope in `data` (any size), its content left encoded; with `consume`, its large
    torch tensors will be views of `data` (writable bytes), whose bytes decoding rearranges."""
    buf = memoryview(data)
    env = LargeEnvelope()
    for number, wire, value in _fields(buf, 0, len(buf)):
        if number == 1 and wire == 2:
            env.msg_type = _text(buf, value)
        elif number in (2, 4) and wire == 0:
            setattr(env, "sender" if number == 2 else "round", _unzigzag(value))
        elif number == 3 and wire == 2:
            pos, stop = value
            while pos < stop:
                r, pos = _varint(buf, pos, stop)
                env.receivers.append(_unzigzag(r))
        elif number == 3 and wire == 0:
            env.receivers.append(_unzigzag(value))
        elif number == 5 and wire == 1:
            env.timestamp = _DOUBLE.unpack(value)[0]
        elif number == 6 and wire == 2:
            env.auth = _text(buf, value)
        elif number == 7 and wire == 2:
            env.content = RawValue(buf, *value, _placer(buf) if consume else None)
    if not env.msg_type:
        raise WireError("envelope has no message type")
    return env


def _placer(buf: memoryview) -> _Placer | None:
    """A placer for `buf` where its tensors may view it: writable bytes (a bytearray, an mmap)."""
    return None if buf.readonly or buf.format != "B" or len(buf) < IN_PLACE_BYTES else _Placer(buf)


def decode_raw_value(raw: RawValue | None, form: str = "torch", depth: int = 0) -> Any:
    """The content an encoded Value holds (what `from_value` gives for a parsed one)."""
    if raw is None:
        return None
    if depth > MAX_DEPTH:
        raise WireError(f"content nested deeper than {MAX_DEPTH} levels")
    buf, placer = raw.buf, raw.placer
    out: Any = None
    for number, wire, value in _fields(buf, raw.start, raw.end):   # the last field of a oneof wins
        if number == 1 and wire == 0:
            out = None
        elif number == 2 and wire == 0:
            out = bool(value)
        elif number == 3 and wire == 0:
            out = _unzigzag(value)
        elif number == 4 and wire == 1:
            out = _DOUBLE.unpack(value)[0]
        elif number == 5 and wire == 2:
            out = _text(buf, value)
        elif number == 6 and wire == 2:
            out = bytes(buf[value[0]:value[1]])
        elif number == 7 and wire == 2:
            out = _tensor(buf, value, form, placer)
        elif number == 8 and wire == 2:
            out = [decode_raw_value(RawValue(buf, *item, placer), form, depth + 1)
                   for n, w, item in _fields(buf, *value) if n == 1 and w == 2]
        elif number == 9 and wire == 2:
            out = {}
            for n, w, entry in _fields(buf, *value):
                if n == 1 and w == 2:
                    key, item = "", None
                    for m, v, span in _fields(buf, *entry):
                        if m == 1 and v == 2:
                            key = _text(buf, span)
                        elif m == 2 and v == 2:
                            item = RawValue(buf, *span, placer)
                    out[key] = decode_raw_value(item, form, depth + 1)
        else:
            raise WireError(f"malformed encoding: unexpected field {number} in a Value")
    return out


def _tensor(buf: memoryview, span: tuple[int, int], form: str, placer: _Placer | None = None) -> Any:
    dtype, shape, data, start = "", [], buf[0:0], 0
    for number, wire, value in _fields(buf, *span):
        if number == 1 and wire == 2:
            dtype = _text(buf, value)
        elif number == 2 and wire == 2:
            pos, stop = value
            while pos < stop:
                d, pos = _varint(buf, pos, stop)
                shape.append(d - (1 << 64) if d >= 1 << 63 else d)
        elif number == 3 and wire == 2:
            data, start = buf[value[0]:value[1]], value[0]
    itemsize = WIRE_DTYPES.get(dtype)
    if itemsize is None:
        raise WireError(f"tensor dtype {dtype!r} is not allowed")
    shape_t = tuple(shape)
    if any(d < 0 for d in shape_t) or math.prod(d for d in shape_t if d) >= 2 ** 62:
        raise WireError(f"tensor shape {shape_t} is not allowed")
    if math.prod(shape_t) * itemsize != len(data):
        raise WireError(f"tensor of shape {shape_t} and dtype {dtype} needs "
                        f"{math.prod(shape_t) * itemsize} bytes, got {len(data)}")
    if placer is not None and form == "torch" and len(data) >= IN_PLACE_BYTES:
        view = placer.tensor(dtype, shape_t, start, len(data), itemsize)
        if view is not None:
            return view
    try:
        return get_form(form).from_wire(dtype, shape_t, data)
    except (ValueError, RuntimeError, OverflowError) as exc:   # what a form's library refuses
        raise WireError(f"tensor of shape {shape_t} and dtype {dtype}: {exc}") from None
