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
import logging
import mmap
import time
from typing import Iterator, Sequence

from fedcore.wire.codec import WireError, content_field, envelope_parts, uvarint
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.spooled import Spool, release_view

__all__ = ["DEFAULT_CHUNK_SIZE", "FIRST_CHUNK", "FRAME_OVERHEAD", "first_chunk_size", "envelope_parts", "SharedContent",
           "chunk_frames", "Reassembler"]

DEFAULT_CHUNK_SIZE = 2 * 1024 * 1024
# A message's first chunk is small, so it arrives at once even on a slow link and tells the
# receiver a message is under way (whose later, larger chunks may take a while each).
FIRST_CHUNK = 16 * 1024
FRAME_OVERHEAD = 256  # bytes of a Frame around its chunk payload (ids, offsets, hash), generously


def first_chunk_size(chunk_size: int, heartbeat_timeout: float, min_rate: float) -> int:
    """Bytes of a message's first chunk: what the slowest link served (`min_rate` bytes/s)
    delivers in an eighth of the heartbeat timeout, at least FIRST_CHUNK and at most a chunk.
    The first frame thus arrives well within the timeout on any link served and tells the
    receiver a message is under way; a message no larger than it travels in one frame."""
    return int(min(chunk_size, max(FIRST_CHUNK, min_rate * heartbeat_timeout / 8)))


SHARED_PIECE = 2 ** 20   # pieces of content this large are sent from where they lie, not copied
HASH_PIECE = 2 ** 24     # bytes of a piece hashed at a time


class SharedContent:
    """One message's encoded content, framed and hashed once, for the envelopes of many receivers.

    Protobuf fields may come in any order, so content + header parses as one
    Envelope (the same fields, the same byte count as header + content): the
    content's share of the SHA-256 is computed once and each receiver's small
    header is hashed on top of a copy of it.

    The content is its encoding, or the pieces of it (`encode_value_parts`): then pieces of
    `SHARED_PIECE` bytes or more (a model's tensors) stay views of the tensors, and the smaller
    ones between them are joined; a broadcast model is then never copied, which holds while
    its tensors are not written until every receiver has it (the global model: aggregators
    replace its tensors, never write them).
    """

    __slots__ = ("field", "content", "pieces", "_digest")

    def __init__(self, content: bytes | list):
        self.pieces = (content,) if isinstance(content, (bytes, bytearray)) else _coalesce(content)
        self.content = content if len(self.pieces) == 1 and self.pieces[0] is content else self.pieces
        self.field = content_field(sum(len(p) for p in self.pieces))
        self._digest = hashlib.sha256(self.field)
        for piece in self.pieces:
            view = memoryview(piece).cast("B")
            for at in range(0, len(view), HASH_PIECE):   # a parked model's pages go back as hashed
                self._digest.update(view[at:at + HASH_PIECE])
                release_view(view[at:at + HASH_PIECE])

    def envelope(self, header: pb.Envelope) -> tuple[tuple[bytes, ...], bytes]:
        """(parts, SHA-256) of the envelope carrying this content under `header`."""
        head = header.SerializeToString()
        digest = self._digest.copy()
        digest.update(head)
        return (self.field, *self.pieces, head), digest.digest()


def _coalesce(pieces: list) -> tuple:
    """`pieces` with each run of small ones joined, the large ones as they are."""
    out, run = [], []
    for piece in pieces:
        if len(piece) >= SHARED_PIECE:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(piece)
        else:
            run.append(piece)
    if run or not out:
        out.append(b"".join(run))
    return tuple(out)


def _field(number: int, wire_type: int) -> bytes:
    return uvarint(number << 3 | wire_type)


def _chunk_head(message_id: int, offset: int, total: int, sha: bytes, n: int) -> tuple[bytes, int]:
    """The bytes of a `Frame` holding a `Chunk` up to its data's bytes, and the frame's length.

    Hand-encoded in protobuf's canonical layout (fields in number order, defaults
    omitted), so `head + data` is byte for byte `Frame(chunk=Chunk(...)).SerializeToString()`
    while the chunk's data are copied only once, into the frame itself.
    """
    inner = bytearray()
    for number, value in ((1, message_id), (2, offset), (3, total)):
        if value:
            inner += _field(number, 0) + uvarint(value)
    if sha:
        inner += _field(4, 2) + uvarint(len(sha)) + sha
    if n:
        inner += _field(5, 2) + uvarint(n)
    inner_len = len(inner) + n
    head = _field(1, 2) + uvarint(inner_len) + bytes(inner)
    return head, len(head) + n


def chunk_frames(parts: Sequence[bytes], message_id: int, chunk_size: int,
                 first_size: int | None = None, sha: bytes | None = None) -> Iterator[bytes]:
    """Serialized `Frame`s carrying the concatenation of `parts`, `chunk_size` bytes at a time
    (the first frame at most `first_size`, when given).

    Each frame is assembled with one copy of its slice of `parts` (no intermediate
    buffer, no protobuf message holding the data). `sha`, when given, is the parts' SHA-256
    computed by the caller (a broadcast hashes its shared content once).
    """
    total = sum(len(p) for p in parts)
    if sha is None:
        digest = hashlib.sha256()
        for p in parts:
            digest.update(p)
        sha = digest.digest()
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    offset, first = 0, True
    while first or offset < total:
        pieces: list = []
        n = 0
        size = min(chunk_size, first_size) if first and first_size else chunk_size
        while views and n < size:
            take = size - n
            v = views[0]
            if take >= len(v):
                pieces.append(v)
                n += len(v)
                views.pop(0)
            else:
                pieces.append(v[:take])
                n += take
                views[0] = v[take:]
        head, _ = _chunk_head(message_id, offset, total, sha if first else b"", n)
        frame = b"".join([head, *pieces])
        for piece in pieces:   # copied: a parked model's pages go back (wire/spooled.py)
            release_view(piece)
        yield frame
        frame = None
        offset += n
        first = False


_said: list[str] = []


def _spool_failed(exc: OSError | ValueError) -> None:
    """A spool file could not be written or mapped: said once; the message goes on in memory."""
    if not _said:
        _said.append(str(exc))
        logging.getLogger("fedcore.deploy").warning(
            "distribute.spool_dir: a large message could not be kept in a file (%s); such "
            "messages are held in memory", exc)


def _verified(data: bytes | bytearray, sha: bytes, message_id: int) -> bytes | bytearray:
    """`data`, once its SHA-256 is the one its first chunk announced."""
    if hashlib.sha256(data).digest() != sha:
        raise WireError(f"message {message_id} failed its integrity check (SHA-256 mismatch)")
    return data


class Reassembler:
    """Rebuilds the envelopes of one stream from its chunks, refusing anything irregular.

    A message of `spool_at` bytes or more is written to an unlinked file in `spool_dir` as it
    arrives and returned mapped (wire/spooled.py); a smaller one, or any where `spool_at` is
    None, is gathered in memory. A file that cannot be written (a full disk) is read back and
    the message goes on in memory, said once in the log."""

    def __init__(self, max_message_bytes: int, max_chunk_bytes: int, spool_at: int | None = None,
                 spool_dir: str | None = None):
        self.max_message = max_message_bytes
        self.max_chunk = max_chunk_bytes
        self.spool_at = spool_at
        self.spool_dir = spool_dir
        self._buf: bytearray | None = None
        self._spool: Spool | None = None
        self._got = 0
        self._id = self._total = 0
        self._sha = b""
        self.started = self.last_chunk = 0.0  # time.monotonic() of the message's first, last chunk

    @property
    def in_progress(self) -> bool:
        return self._buf is not None or self._spool is not None

    def progress(self, at_least: int = 0) -> tuple[float, int] | None:
        """The message in progress, if of `at_least` bytes: when its first chunk came and its
        bytes so far (None between messages, or for a smaller one)."""
        return (self.started, self._got) if self.in_progress and self._total >= at_least else None

    def feed(self, chunk: pb.Chunk) -> bytes | bytearray | mmap.mmap | None:
        """Take one chunk; return the whole envelope's bytes when this chunk completes it
        (the chunk's own bytes, the reassembly buffer, or a spooled message's mapping:
        protobuf and the large-envelope decoder read any without another copy)."""
        data = chunk.data   # protobuf makes a new copy of a bytes field at each access
        if len(data) > self.max_chunk:
            raise WireError(f"chunk of {len(data)} bytes exceeds the {self.max_chunk}-byte limit")
        if not self.in_progress:
            if chunk.offset != 0:
                raise WireError(f"message {chunk.message_id} starts at offset {chunk.offset}, not 0")
            if chunk.total_size > self.max_message:
                raise WireError(f"message of {chunk.total_size} bytes exceeds the "
                                f"{self.max_message}-byte limit (distribute.max_message_bytes)")
            if len(chunk.sha256) != 32:
                raise WireError("first chunk of a message lacks its SHA-256")
            if len(data) == chunk.total_size:   # a whole message in one chunk: no buffer
                self.last_chunk = time.monotonic()
                return _verified(data, chunk.sha256, chunk.message_id)
            self._id, self._total, self._sha = chunk.message_id, chunk.total_size, chunk.sha256
            self._got = 0
            self._start_buffer()
            self.started = time.monotonic()
        else:
            if chunk.message_id != self._id:
                raise WireError(f"message {self._id} truncated at {self._got} of {self._total} "
                                f"bytes: message {chunk.message_id} began")
            if chunk.offset != self._got or chunk.total_size != self._total:
                raise WireError(f"chunk of message {self._id} out of order (offset {chunk.offset}, "
                                f"expected {self._got})")
        if not data and self._total:
            raise WireError("empty chunk inside a non-empty message")
        if self._got + len(data) > self._total:
            raise WireError(f"message {self._id} has more bytes than the {self._total} announced")
        self._append(data)
        self.last_chunk = time.monotonic()
        if self._got < self._total:
            return None
        if self._spool is not None:
            spool, self._spool = self._spool, None
            if spool.hash.digest() != self._sha:
                spool.close()
                raise WireError(f"message {self._id} failed its integrity check (SHA-256 mismatch)")
            try:
                return spool.mapping()
            except (OSError, ValueError) as exc:   # no room to map it: the message in memory
                _spool_failed(exc)
                return self._read_back(spool)
        data, self._buf = self._buf, None
        return _verified(data, self._sha, self._id)

    def _read_back(self, spool: Spool) -> bytearray:
        """What `spool` holds, in memory (its file closed), or WireError if it cannot be read."""
        try:
            return spool.read_all()
        except OSError as exc:
            raise WireError(f"message {self._id} could not be read back from its spool file: "
                            f"{exc}") from None

    def _start_buffer(self) -> None:
        if self.spool_at is not None and self._total >= self.spool_at:
            try:
                self._spool = Spool(self.spool_dir)
                return
            except OSError as exc:
                _spool_failed(exc)
        self._buf = bytearray()

    def _append(self, data: bytes) -> None:
        if self._spool is not None:
            try:
                self._spool.write(data)
                self._got += len(data)
                return
            except OSError as exc:   # a full disk: what was written goes on in memory
                _spool_failed(exc)
                spool, self._spool = self._spool, None
                self._buf = self._read_back(spool)
        self._buf += data
        self._got += len(data)

    def stalled(self, timeout: float, min_rate: float) -> str | None:
        """Why the message in progress has taken too long (None if it has not): a chunk must come
        within `timeout` plus a chunk's time at `min_rate` bytes/s, and the whole message within
        `timeout` plus its size's time at `min_rate`. Heartbeats do not keep a message alive."""
        if not self.in_progress:
            return None
        now = time.monotonic()
        if now - self.last_chunk > timeout + self.max_chunk / min_rate:
            return (f"message {self._id} stalled at {self._got} of {self._total} bytes "
                    f"(no chunk for {now - self.last_chunk:.0f}s)")
        if now - self.started > timeout + self._total / min_rate:
            return (f"message {self._id} too slow: {self._got} of {self._total} bytes in "
                    f"{now - self.started:.0f}s (below distribute.min_bytes_per_second={min_rate:g})")
        return None

    def drop(self) -> None:
        """Forget the message in progress (its stream is being closed)."""
        self._buf = None
        if self._spool is not None:
            self._spool, spool = None, self._spool
            spool.close()

    def end_of_stream(self) -> None:
        """The stream closed: a half-received message is an error worth naming."""
        if self.in_progress:
            got = self._got
            self.drop()
            raise WireError(f"stream ended inside message {self._id} ({got} of {self._total} bytes)")
