"""Run a module as a program and write its peak resident memory when it exits.

    python -m bench.peak_rss OUT_FILE MODULE [ARGS ...]

OUT_FILE receives the process's peak RSS in bytes, written at exit, however the program
ends: Linux's VmHWM, the high-water mark of this program's own memory (getrusage's
ru_maxrss survives fork and exec, so it would report a larger parent's peak), or
ru_maxrss where /proc is missing; how the server's memory is measured
in bench/w8_large_model.py and tests/test_streaming.py.
"""
from __future__ import annotations

import atexit
import resource
import runpy
import sys
from pathlib import Path


def peak_rss() -> int:
    """This process's peak resident memory in bytes, since it was exec'd."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _write(path: Path) -> None:
    path.write_text(str(peak_rss()))


def main() -> None:
    out, module, *args = sys.argv[1:]
    atexit.register(_write, Path(out))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
