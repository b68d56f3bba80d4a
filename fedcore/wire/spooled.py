"""Large received messages kept in a file and mapped, their pages given back once read.

A server folding updates (algorithms/streaming.py) needs each update once, a slice at a
time, but the update arrives whole before its integrity check (the SHA-256 at its end)
lets it touch the running sum: held in memory, it is one model of the server's peak.
Written instead to an unlinked file in `distribute.spool_dir` as its chunks arrive, it
costs the system's page cache, not the server: the file is mapped shared (`Spool.mapping`),
decoded tensors view the mapping as they view a received bytearray (wire/large.py), and
whatever reads them a slice at a time (the finiteness check, the fold) calls `release`
after each slice, which unmaps those pages from the process (`MADV_DONTNEED`; a shared
mapping's bytes stay in the file, so a later read faults them in again, unchanged). The
file goes when its last tensor does (the mapping closes, and with it the last reference).

`park` puts tensors there on purpose: a folding round's global model, idle while the round
collects (runtime/parking.py), is written to such a file and replaced by views of its
mapping; sending it reads it through those views, and `release_view` gives each frame's
pages back once the frame is built (comm/chunking.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
import os
import tempfile
import weakref
from typing import Any

__all__ = ["Spool", "release", "release_view", "park", "blank", "copy_released", "is_mapped",
           "mapped_bytes"]

PAGE = mmap.PAGESIZE
_MAPPINGS: dict[int, tuple[int, int, weakref.ref]] = {}   # id -> (address, size, mapping)


class Spool:
    """One message being received into an unlinked file, with the SHA-256 of what came so far."""

    def __init__(self, folder: str | os.PathLike | None, hashed: bool = True) -> None:
        # unlinked at once, nothing left behind; unbuffered: what `size` counts is in the file
        self.file = tempfile.TemporaryFile(dir=folder, buffering=0)
        self.size = 0
        self.hash = hashlib.sha256() if hashed else None

    def write(self, data: bytes) -> None:
        """Append `data` (OSError, a full disk: `size` still counts only what went in whole)."""
        view, fd, done = memoryview(data), self.file.fileno(), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], self.size + done)
        if self.hash is not None:
            self.hash.update(view)
        self.size += len(view)

    def read_all(self) -> bytearray:
        """What was written, in memory (where the file cannot go on: a full disk); closes it."""
        out = bytearray(self.size)
        view, fd, done = memoryview(out), self.file.fileno(), 0
        try:
            while done < self.size:
                n = os.preadv(fd, [view[done:]], done)
                if n == 0:
                    raise OSError(f"spool file ended at {done} of {self.size} bytes")
                done += n
        finally:
            self.close()
        return out

    def mapping(self) -> mmap.mmap:
        """The whole message, mapped shared and writable (decoding aligns tensors in place);
        the file is closed, the mapping holding it until it is let go. Where it cannot be
        mapped (OSError, e.g. no address space left) the file stays open for `read_all`."""
        mm = mmap.mmap(self.file.fileno(), self.size, access=mmap.ACCESS_WRITE)
        self.close()
        anchor = (ctypes.c_char * 1).from_buffer(mm)
        address = ctypes.addressof(anchor)
        del anchor   # an exported buffer would keep the mapping from closing
        key = id(mm)
        _MAPPINGS[key] = (address, self.size, weakref.ref(mm))
        weakref.finalize(mm, _MAPPINGS.pop, key, None)
        return mm

    def close(self) -> None:
        self.file.close()


def release(t: Any) -> None:
    """Unmap the pages of a spooled mapping that torch tensor `t` lies on (no-op for any other
    memory): `t` was read, the file keeps its bytes."""
    if _MAPPINGS:
        _release_span(t.data_ptr(), t.numel() * t.element_size())


def release_view(view: Any) -> None:
    """`release` for a buffer (a memoryview of a tensor's bytes, a frame's slice of it)."""
    if _MAPPINGS and len(view):
        import numpy
        data = numpy.frombuffer(view, dtype=numpy.uint8)
        _release_span(data.ctypes.data, data.nbytes)


def is_mapped(t: Any) -> bool:
    """Whether torch tensor `t` lies on a spooled mapping."""
    return _mapping_at(t.data_ptr()) is not None


def _mapping_at(start: int) -> tuple[int, int, mmap.mmap] | None:
    """(address, size, mapping) of the open spooled mapping that address `start` lies in."""
    for address, size, ref in list(_MAPPINGS.values()):
        if address <= start < address + size:
            mm = ref()
            if mm is not None and not mm.closed:
                return address, size, mm
    return None


RELEASE_BEHIND = 2 ** 21   # bytes before a released span given back too (see `_release_span`)


def _release_span(start: int, nbytes: int) -> None:
    """Unmap [start, start + nbytes) of the mapping it lies in, and the RELEASE_BEHIND bytes
    before it: a read maps the whole page-cache folio it touches (up to 2 MiB), so the next
    span's first read maps the tail of this one's last folio again, which its own release
    would not cover (read forward a span at a time, a quarter to a half of a file stayed
    resident)."""
    found = _mapping_at(start)
    if found is not None:
        address, size, mm = found
        lo = max(0, (start - address - RELEASE_BEHIND) // PAGE * PAGE)
        hi = min(size, start + nbytes - address)
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


ALIGN = 64   # a parked tensor's offset in its file: aligned for any dtype (and SIMD loads)
WRITE_PIECE = 2 ** 26   # bytes written at a time


def park(tensors: dict[str, Any], folder: str | os.PathLike | None) -> dict[str, Any]:
    """`tensors` (CPU torch tensors) copied into one unlinked file in `folder`, returned as
    views of its shared mapping: equal values, the same dtypes and shapes, and no page in the
    process until something reads them (`release` gives them back). The file goes with the
    last view. OSError where the file cannot be written or mapped (nothing is then replaced)."""
    import torch
    spool = Spool(folder, hashed=False)
    spans: dict[str, tuple[int, Any]] = {}
    try:
        for name, t in tensors.items():
            pad = -spool.size % ALIGN
            if pad:
                spool.write(bytes(pad))
            spans[name] = (spool.size, t)
            data = t.detach().reshape(-1).view(torch.uint8).numpy()   # a copy only if not contiguous
            for at in range(0, len(data), WRITE_PIECE):
                spool.write(memoryview(data[at:at + WRITE_PIECE]))
        if not spool.size:   # nothing to map (empty tensors): they stay as they are
            spool.close()
            return dict(tensors)
        mm = spool.mapping()
    except BaseException:
        spool.close()
        raise
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    return {name: whole[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for name, (at, t) in spans.items()}


def blank(specs: dict[str, tuple[tuple[int, ...], Any]], folder: str | os.PathLike | None) -> dict[str, Any]:
    """Zero tensors of the given (shape, dtype) in one new unlinked file in `folder`, as views of
    its shared mapping: what is written through them goes to the file, and `release` gives
    their pages back to it (a simulation's running sum and server moments, kept out of
    memory while clients train). The file is sparse until written; OSError as for `park`."""
    import torch
    spool = Spool(folder, hashed=False)
    spans, size = {}, 0
    for name, (shape, dtype) in specs.items():
        size += -size % ALIGN
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        spans[name] = (size, nbytes, shape, dtype)
        size += nbytes
    try:
        os.ftruncate(spool.file.fileno(), max(size, 1))
        spool.size = max(size, 1)
        mm = spool.mapping()
    except BaseException:
        spool.close()
        raise
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    return {name: whole[at:at + nbytes].view(dtype).view(shape)
            for name, (at, nbytes, shape, dtype) in spans.items()}


COPY_STEP = 2 ** 22   # bytes of a mapped tensor copied before their pages are given back


def copy_released(dst: Any, src: Any) -> None:
    """dst.copy_(src), a slice at a time where `src` lies on a spooled mapping, each slice's
    pages given back once copied: reading a parked model into a working copy maps it whole
    otherwise (one model more in the process until the mapping goes)."""
    if not _MAPPINGS or not is_mapped(src):
        dst.copy_(src)
        return
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.shape != src.shape:
        dst.copy_(src)
        release(src)
        return
    out, data = dst.view(-1), src.view(-1)
    step = max(1, COPY_STEP // max(1, src.element_size()))
    for at in range(0, data.numel(), step):
        part = data[at:at + step]
        out[at:at + step].copy_(part)
        release(part)


def mapped_bytes() -> int:
    """Bytes of spooled messages still mapped (tests: a message's file goes with its tensors)."""
    return sum(size for _, size, ref in list(_MAPPINGS.values()) if ref() is not None)
