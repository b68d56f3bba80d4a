"""The deployed server's allocator settings (glibc): freed heap pages go back to the system."""
import platform
import subprocess
import sys

import pytest

from tests.deploy_helpers import ROOT, _env

# In a fresh process: blocks of 512 KiB (below the 1 MiB threshold release_large_blocks sets,
# so they come from the heap), all freed but the last, which keeps the freed ones off the
# heap's top (glibc gives the top back by itself); then trim. RSS from /proc, in bytes.
SCRIPT = """
import ctypes, ctypes.util
from fedcore.comm.allocator import release_large_blocks, trim
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
assert release_large_blocks()
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(512 * 1024) for _ in range(101)]
for b in blocks:
    ctypes.memset(b, 1, 512 * 1024)
for b in blocks[:-1]:
    libc.free(b)
before = rss()
trim()
print(before, rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_gives_freed_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT,
                         env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    freed = 100 * 512 * 1024          # the freed blocks, 50 MiB, held until the trim
    assert before - after > 0.9 * freed, (before, after)


# Eight threads each allocate and keep a block: glibc gives each a heap of its own unless the
# number of heaps is capped; malloc_info lists the heaps (one <heap nr=...> each).
THREADS = """
import ctypes, ctypes.util, sys, tempfile, threading
from fedcore.comm.allocator import ARENAS, release_large_blocks
if sys.argv[1] == "capped":
    assert release_large_blocks()
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
kept, gate = [], threading.Barrier(8)
def work():
    gate.wait()                      # all eight at once: none finds a heap free
    kept.append(libc.malloc(4096))
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
path = tempfile.mktemp()
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
print(open(path).read().count("<heap nr="), ARENAS)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the heaps are glibc's")
def test_the_server_keeps_glibcs_heaps_to_a_few_whatever_its_threads():
    counts = {}
    for mode in ("default", "capped"):
        out = subprocess.run([sys.executable, "-c", THREADS, mode], capture_output=True, text=True,
                             cwd=ROOT, env={k: v for k, v in _env().items() if k != "MALLOC_ARENA_MAX"},
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        counts[mode], arenas = map(int, out.stdout.split())
    assert counts["capped"] <= arenas < counts["default"], counts
