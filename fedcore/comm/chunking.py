"""Large envelopes as a stream of bounded chunks, reassembled and integrity-checked.

A sender turns one encoded envelope (given as a few byte buffers, so a model
broadcast to many clients shares one encoding of its content) into `Chunk`
frames of at most `chunk_size` bytes of payload. A receiver's `Reassembler`
accepts chunks strictly in order, refuses a message whose announced length
exceeds its limit before buffering anything, and checks length and SHA-256
once the last byte is in. Every violation raises `WireError`.
"""
from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

from fedcore.serialization import WireError
from fedcore.wire import fedcore_pb2 as pb

__all__ = ["DEFAULT_CHUNK_SIZE", "FRAME_OVERHEAD", "envelope_parts", "chunk_frames", "Reassembler"]

DEFAULT_CHUNK_SIZE = 2 * 1024 * 1024
FRAME_OVERHEAD = 256  # bytes of a Frame around its chunk payload (ids, offsets, hash), generously


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def envelope_parts(header: pb.Envelope, content: bytes) -> tuple[bytes, bytes, bytes]:
    """The bytes of `header` with `content` (an encoded Value) as its field 7, in three parts.

    Protobuf fields may come in any order, so header + tag + length + content
    parses as one Envelope; the content is never copied per receiver.
    """
    return header.SerializeToString(), b"\x3a" + _varint(len(content)), content


def chunk_frames(parts: Sequence[bytes], message_id: int, chunk_size: int) -> Iterator[bytes]:
    """Serialized `Frame`s carrying the concatenation of `parts`, `chunk_size` bytes at a time."""
    total = sum(len(p) for p in parts)
    digest = hashlib.sha256()
    for p in parts:
        digest.update(p)
    sha = digest.digest()
    views = [memoryview(p) for p in parts if len(p)]
    offset, first = 0, True
    buf = bytearray()
    while first or offset < total:
        buf.clear()
        while views and len(buf) < chunk_size:
            take = chunk_size - len(buf)
            buf += views[0][:take]
            if take >= len(views[0]):
                views.pop(0)
            else:
                views[0] = views[0][take:]
        frame = pb.Frame(chunk=pb.Chunk(message_id=message_id, offset=offset, total_size=total,
                                        sha256=sha if first else b"", data=bytes(buf)))
        yield frame.SerializeToString()
        offset += len(buf)
        first = False


class Reassembler:
    """Rebuilds the envelopes of one stream from its chunks, refusing anything irregular."""

    def __init__(self, max_message_bytes: int, max_chunk_bytes: int):
        self.max_message = max_message_bytes
        self.max_chunk = max_chunk_bytes
        self._buf: bytearray | None = None
        self._id = self._total = 0
        self._sha = b""

    @property
    def in_progress(self) -> bool:
        return self._buf is not None

    def feed(self, chunk: pb.Chunk) -> bytearray | None:
        """Take one chunk; return the whole envelope's bytes when this chunk completes it
        (the reassembly buffer itself: protobuf parses it without another copy)."""
        if len(chunk.data) > self.max_chunk:
            raise WireError(f"chunk of {len(chunk.data)} bytes exceeds the {self.max_chunk}-byte limit")
        if self._buf is None:
            if chunk.offset != 0:
                raise WireError(f"message {chunk.message_id} starts at offset {chunk.offset}, not 0")
            if chunk.total_size > self.max_message:
                raise WireError(f"message of {chunk.total_size} bytes exceeds the "
                                f"{self.max_message}-byte limit (distribute.max_message_bytes)")
            if len(chunk.sha256) != 32:
                raise WireError("first chunk of a message lacks its SHA-256")
            self._id, self._total, self._sha = chunk.message_id, chunk.total_size, chunk.sha256
            self._buf = bytearray()
        else:
            if chunk.message_id != self._id:
                raise WireError(f"message {self._id} truncated at {len(self._buf)} of {self._total} "
                                f"bytes: message {chunk.message_id} began")
            if chunk.offset != len(self._buf) or chunk.total_size != self._total:
                raise WireError(f"chunk of message {self._id} out of order (offset {chunk.offset}, "
                                f"expected {len(self._buf)})")
        if not chunk.data and self._total:
            raise WireError("empty chunk inside a non-empty message")
        if len(self._buf) + len(chunk.data) > self._total:
            raise WireError(f"message {self._id} has more bytes than the {self._total} announced")
        self._buf += chunk.data
        if len(self._buf) < self._total:
            return None
        data, self._buf = self._buf, None
        if hashlib.sha256(data).digest() != self._sha:
            raise WireError(f"message {self._id} failed its integrity check (SHA-256 mismatch)")
        return data

    def end_of_stream(self) -> None:
        """The stream closed: a half-received message is an error worth naming."""
        if self._buf is not None:
            got, self._buf = len(self._buf), None
            raise WireError(f"stream ended inside message {self._id} ({got} of {self._total} bytes)")
