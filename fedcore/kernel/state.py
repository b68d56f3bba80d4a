"""Per-logical-client state: control variates, dual variables, optimizer
moments, sampler positions, history buffers, keyed by client id.

Trainers are shared by many logical clients, so anything a client must keep
between rounds lives here, never on the trainer. `MemoryStateStore` keeps
it in a dict; `DiskStateStore` keeps them on disk so N can be large.
"""
from __future__ import annotations

import os
import struct
import zlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from fedcore.kernel.files import create_new, write_atomic
from fedcore.wire.serialization import WireError, from_value
from fedcore.wire.codec import encode_value_parts
from fedcore.wire.large import IN_PLACE_BYTES, RawValue, _placer, decode_raw_value
from fedcore.wire import fedcore_pb2 as pb

__all__ = ["StateStore", "MemoryStateStore", "DiskStateStore", "make_state_store"]


class StateStore:
    """Interface: `load` a client's state dict (empty if new), `save` it back."""

    def load(self, client_id: int) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, client_id: int, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def __contains__(self, client_id: int) -> bool:
        raise NotImplementedError

    def disk_bytes(self) -> int:
        """Bytes this store occupies on disk (0 for memory)."""
        return 0

    def close(self) -> None:
        """Release resources (temporary folders)."""


class MemoryStateStore(StateStore):
    def __init__(self) -> None:
        self._states: dict[int, dict[str, Any]] = {}

    def load(self, client_id: int) -> dict[str, Any]:
        return self._states.get(client_id, {})

    def save(self, client_id: int, state: dict[str, Any]) -> None:
        if state:
            self._states[client_id] = state
        else:
            self._states.pop(client_id, None)

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._states


_RECORD = struct.Struct("<4sqQI")   # magic, client id, payload length, CRC-32 of the payload
_MAGIC = b"FCR1"
_LOG = "states.log"


def plain_state(obj: Any, depth: int = 0) -> bool:
    """True for str-keyed dicts whose leaves are tensors, ints or bools (control variates,
    sampler positions): what the compact format holds exactly."""
    if isinstance(obj, dict):
        return depth < 8 and all(isinstance(k, str) and plain_state(v, depth + 1) for k, v in obj.items())
    return isinstance(obj, (torch.Tensor, int, bool))


class DiskStateStore(StateStore):
    """Client states on disk, so that N can be far larger than memory allows.

    States made of tensors and integers under string keys (control variates,
    dual variables, sampler positions) are appended as records to one log file,
    `states.log`: a header (client id, length, CRC-32) and the state as one
    `fedcore.wire.serialization` message - no pickle, and no file created per client
    (creating files is what costs most on many file systems). An index in
    memory points at each client's newest record; it is rebuilt by scanning the
    log when a store opens an existing folder, and a record cut short by a crash
    ends the scan (the log is truncated there). Superseded records are garbage;
    the log is compacted when they outweigh the live ones.

    Other states (optimizer state with integer keys, scheduler floats) go to one
    `torch.save` file per client, `client_<id>.pt`, written atomically and read
    with `weights_only=True`. The folder belongs to one store at a time.
    """

    COMPACT_MIN_BYTES = 64 * 2 ** 20   # never compact a log smaller than this
    COPY_PIECE = 2 ** 24                # bytes of a record copied at a time by a compaction

    def __init__(self, path: str | None = None) -> None:
        self._tmp = path is None
        self.path = Path(path if path is not None else tempfile.mkdtemp(prefix="fedcore-state-"))
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._where: dict[int, tuple[int, int] | str] = {}   # id -> (offset, length) or ".pt"
        self._live = 0                                       # bytes of the records in use
        with os.scandir(self.path) as entries:
            for e in entries:
                stem, _, ext = e.name.rpartition(".")
                if ext == "pt" and stem.startswith("client_") and stem[7:].isdigit():
                    self._where[int(stem[7:])] = ".pt"
        self._fd = os.open(self.path / _LOG, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self._end = self._scan()

    # ------------------------------------------------------------ the log
    def _scan(self) -> int:
        """Index the log's records; truncate a torn last record; return the log's length.

        A client's last log entry decides: a record is its state (a `.pt` file left
        beside it is an older one); an empty record (tombstone) defers to its `.pt`.
        """
        size = os.fstat(self._fd).st_size
        off = 0
        last: dict[int, tuple[int, int] | None] = {}
        while off + _RECORD.size <= size:
            magic, cid, n, crc = _RECORD.unpack(os.pread(self._fd, _RECORD.size, off))
            body = off + _RECORD.size
            if magic != _MAGIC or body + n > size or zlib.crc32(os.pread(self._fd, n, body)) != crc:
                break
            last[cid] = (body, n) if n else None
            off = body + n
        if off < size:
            os.ftruncate(self._fd, off)
        for cid, loc in last.items():
            if loc is None:
                continue
            if self._where.get(cid) == ".pt":
                self._pt(cid).unlink(missing_ok=True)
            self._where[cid] = loc
            self._live += _RECORD.size + loc[1]
        return off

    def _forget(self, client_id: int) -> None:
        """Drop the index entry (its record becomes garbage); never touches files."""
        old = self._where.pop(client_id, None)
        if isinstance(old, tuple):
            self._live -= _RECORD.size + old[1]

    def _append(self, client_id: int, payload: bytes | list) -> None:
        """Append a record of `payload` (bytes, or the pieces whose concatenation it is: a large
        state is written from its tensors, not first copied into one buffer)."""
        parts = [memoryview(p).cast("B") for p in ([payload] if isinstance(payload, bytes) else payload)]
        n, crc = sum(len(p) for p in parts), 0
        for p in parts:
            crc = zlib.crc32(p, crc)
        os.write(self._fd, _RECORD.pack(_MAGIC, client_id, n, crc))
        for p in parts:
            while len(p):   # a write may take less than it was given
                p = p[os.write(self._fd, p):]
        if n:
            self._where[client_id] = (self._end + _RECORD.size, n)
            self._live += _RECORD.size + n
        self._end += _RECORD.size + n

    def _maybe_compact(self) -> None:
        """Rewrite the log with only the records in use, once garbage outweighs them."""
        if self._live == 0 and self._end:    # nothing in use: the log empties
            os.ftruncate(self._fd, 0)
            self._end = 0
            return
        if self._end < self.COMPACT_MIN_BYTES or self._end < 2 * self._live:
            return
        tmp = self.path / (_LOG + ".tmp")
        fd = create_new(tmp, os.O_RDWR | os.O_APPEND)
        end, where = 0, {}
        for cid, loc in self._where.items():
            if isinstance(loc, tuple):
                # the record as it is (its header says this client, this length, this CRC), a
                # piece at a time: a large state is not read into memory whole
                at, stop = loc[0] - _RECORD.size, loc[0] + loc[1]
                while at < stop:
                    piece = memoryview(os.pread(self._fd, min(self.COPY_PIECE, stop - at), at))
                    if not piece:
                        raise OSError(f"{self.path / _LOG}: ends inside the record of client {cid}")
                    at += len(piece)
                    while piece:
                        piece = piece[os.write(fd, piece):]
                where[cid] = (end + _RECORD.size, loc[1])
                end += _RECORD.size + loc[1]
        os.replace(tmp, self.path / _LOG)
        os.close(self._fd)
        self._fd, self._end, self._live = fd, end, end
        self._where.update(where)

    def _pt(self, client_id: int) -> Path:
        return self.path / f"client_{client_id}.pt"

    # ------------------------------------------------------------ the interface
    def load(self, client_id: int) -> dict[str, Any]:
        loc = self._where.get(client_id)
        if loc is None:
            return {}
        if loc == ".pt":
            return torch.load(self._pt(client_id), weights_only=True)
        if loc[1] >= IN_PLACE_BYTES:   # large: its tensors view the bytes read, not copies of them
            head, buf = bytearray(_RECORD.size), memoryview(bytearray(loc[1]))
            try:
                if os.preadv(self._fd, [head, buf], loc[0] - _RECORD.size) != _RECORD.size + loc[1]:
                    raise WireError("the log ends inside it")
                if _RECORD.unpack(head) != (_MAGIC, client_id, loc[1], zlib.crc32(buf)):
                    raise WireError("its record's header or CRC-32 does not match")
                return decode_raw_value(RawValue(buf, 0, loc[1], _placer(buf)))
            except WireError as exc:
                raise WireError(f"{self.path / _LOG}: the state of client {client_id} is damaged: "
                                f"{exc}") from None
        v = pb.Value()
        try:
            v.ParseFromString(os.pread(self._fd, loc[1], loc[0]))
        except Exception as exc:  # noqa: BLE001 - protobuf's parse errors vary by backend
            raise WireError(f"{self.path / _LOG}: the state of client {client_id} is damaged: "
                            f"{exc}") from None
        return from_value(v)

    def save(self, client_id: int, state: dict[str, Any]) -> None:
        was = self._where.get(client_id)
        if state and plain_state(state):
            payload = encode_value_parts(state)
            self._forget(client_id)
            self._append(client_id, payload)       # the new record supersedes everything older
            if was == ".pt":
                self._pt(client_id).unlink(missing_ok=True)
            self._maybe_compact()
            return
        f = self._pt(client_id)
        if state:
            write_atomic(f, lambda fh: torch.save(state, fh), sync=False)  # a crash never leaves half a state
        else:
            f.unlink(missing_ok=True)
        self._forget(client_id)
        if isinstance(was, tuple):
            self._append(client_id, b"")           # a tombstone: the log's record no longer counts
            self._maybe_compact()
        if state:
            self._where[client_id] = ".pt"

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._where

    def disk_bytes(self) -> int:
        return self._end + sum(f.stat().st_size for f in self.path.glob("client_*.pt"))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tmp:
            shutil.rmtree(self.path, ignore_errors=True)


def make_state_store(kind: str, path: str | None) -> StateStore:
    """Build the store named by `state.store`."""
    return DiskStateStore(path) if kind == "disk" else MemoryStateStore()
