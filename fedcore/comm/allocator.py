"""A deployed server (and client) hands freed model-sized buffers back to the system at once (glibc).

glibc's malloc serves a request from its heaps below a threshold that grows, each time a
large block is freed, up to 32 MiB; above it, a block is mapped on its own and unmapped
when freed. A server moving a large model allocates and frees, round after round, chunk
frames (2 MiB), reassembly and decode buffers and tensors, on several threads (gRPC's, the
decoder's, the scheduler's), each with its own heap: once the threshold has grown, those
heaps keep what was freed, and a server of a 100 MB model kept about 2.5 models more than
it held (measured: peak RSS 1.32 GB against 1.06 GB, 4 clients, two rounds). Fixing the
threshold at 1 MiB (`mallopt(M_MMAP_THRESHOLD)`, which also stops it growing) maps every
larger block on its own. Elsewhere than glibc nothing changes.

Each thread that allocates gets a heap of its own (up to 8 a core), and gRPC adds threads as
its load grows: every new heap kept what its thread's messages left, so a server folding
updates of a 17 MiB model peaked 11-23 MB higher with 16 clients than with 4 (one model's
worth, as the clients' own updates were let go sooner); with the heaps kept to `ARENAS`,
3-11 MB (tests/test_streaming.py's memory test, 2 shared cores, 2026-11-26). A deployed
client sets the same threshold: its peak with a 300 MB model fell from 1.70 to 1.63 GB.

Below that threshold, what receiving a large message allocates in pieces (gRPC's slices,
protobuf's frames, a model's small tensors) is freed among other allocations and stays in
the heaps: a server folding updates of a 17 MiB model peaked 19-20 MB higher with 16 clients
than with 4, and 10-11 MB once `trim` (`malloc_trim`: the free pages of every heap go back)
runs after each large message is decoded, before it is folded (tests/test_streaming.py's
memory test; 2 shared cores, 2026-11-26).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["MMAP_THRESHOLD", "ARENAS", "release_large_blocks", "trim"]

MMAP_THRESHOLD = 2 ** 20   # blocks at least this large are mapped on their own, unmapped when freed
ARENAS = 2                 # heaps shared by all threads (glibc's default: 8 per core)
_M_MMAP_THRESHOLD = -3     # glibc's malloc.h
_M_ARENA_MAX = -8


def release_large_blocks() -> bool:
    """Have glibc map blocks of `MMAP_THRESHOLD` bytes or more on their own, and keep its heaps
    to `ARENAS`, for the rest of the process; True where it took the settings."""
    libc = _glibc()
    return (libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(libc.mallopt(_M_ARENA_MAX, ARENAS)))


def trim() -> None:
    """Hand the free pages of glibc's heaps back to the system (elsewhere: nothing)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


_LIBC: list = []


def _glibc():
    """glibc's handle, or None where the C library is another or will not load."""
    if not _LIBC:
        libc = None
        if platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.mallopt, libc.malloc_trim   # both there, or none is used
            except (OSError, AttributeError):
                libc = None
        _LIBC.append(libc)
    return _LIBC[0]
