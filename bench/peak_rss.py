"""Run a module as a program and write its peak resident memory when it exits.

    python -m bench.peak_rss OUT_FILE MODULE [ARGS ...]

OUT_FILE receives the process's peak RSS in bytes (`getrusage`'s ru_maxrss, KiB on
Linux), written at exit, however the program ends; how the server's memory is measured
in bench/w8_large_model.py and tests/test_streaming.py.
"""
from __future__ import annotations

import atexit
import resource
import runpy
import sys
from pathlib import Path


def _write(path: Path) -> None:
    path.write_text(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def main() -> None:
    out, module, *args = sys.argv[1:]
    atexit.register(_write, Path(out))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
