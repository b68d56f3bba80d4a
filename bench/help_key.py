"""How long `python -m fedcore.run --help-key KEY` takes, against importing the full schema.

    PYTHONPATH=. python bench/help_key.py [--repeat 5] [--key federate.total_round_num]

Both are fresh interpreters: the first answers from the packaged key index; the second imports
what the full schema needs (every built-in plug-in, and torch), which is what --help-key did
before the index. Prints the median wall seconds and the children's CPU seconds of each, and
their ratio; on a busy machine the CPU seconds are the steadier figure.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

FULL_SCHEMA = "from fedcore.kernel.config import load_builtin_plugins; load_builtin_plugins()"


def _timed(cmd: list[str], repeat: int) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds) of `repeat` runs of `cmd`."""
    walls, cpus = [], []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--key", default="federate.total_round_num")
    a = p.parse_args()
    fast = _timed([sys.executable, "-m", "fedcore.run", "--help-key", a.key], a.repeat)
    full = _timed([sys.executable, "-c", FULL_SCHEMA], a.repeat)
    print(f"--help-key {a.key}: {fast[0]:.3f} s wall, {fast[1]:.3f} s CPU (median of {a.repeat})")
    print(f"full schema import: {full[0]:.3f} s wall, {full[1]:.3f} s CPU")
    print(f"ratio (full / --help-key): {full[0] / fast[0]:.1f}x wall, {full[1] / fast[1]:.1f}x CPU")


if __name__ == "__main__":
    main()
