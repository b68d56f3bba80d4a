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
