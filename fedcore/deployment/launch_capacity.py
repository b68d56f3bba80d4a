"""Whether a launch asks more of the machine than it holds, said before it starts.

A fresh interpreter that runs a course imports torch, gRPC and fedcore: about three seconds
of CPU and about 250 MB resident before its course builds anything (Linux, CPU-only torch),
so `IMPORT_MB` counts 300 with its course. Spawned, N clients on few cores import at once and
no round runs until the last of them joins; forked from the fork server, they share one import
(its pages too, copy on write). The launcher warns in one line, with the figures, and starts
the launch anyway: the machine may be faster, or the operator may know better.
"""
from __future__ import annotations

import os

__all__ = ["PER_CORE", "IMPORT_MB", "cores", "available_mb", "crowding"]

PER_CORE = 4        # fresh interpreters a core starts before the first of them is slow to join
IMPORT_MB = 300     # resident memory of a fresh interpreter running a small course
IMPORT_CPU_S = 3    # CPU seconds of its imports


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_mb() -> float | None:
    """Memory available to new processes (Linux's MemAvailable), in MB; None where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def crowding(processes: int, spawned: bool, forkserver_available: bool, n_cores: int,
             memory_mb: float | None) -> str | None:
    """The warning line for a launch of `processes` (server, edges, clients), or None.
    `spawned`: each starts as a fresh interpreter (else forked from the fork server)."""
    if not spawned:
        return None   # one import for all, and its pages shared
    fix = "--start-method forkserver shares one import" if forkserver_available else None
    if memory_mb is not None and processes * IMPORT_MB > memory_mb:
        return (f"fedcore.launch: starting {processes} interpreters of ~{IMPORT_MB} MB each "
                f"(~{processes * IMPORT_MB} MB) with {memory_mb:.0f} MB available; "
                f"{fix or 'fewer clients per launch'}")
    if processes > PER_CORE * n_cores:
        return (f"fedcore.launch: starting {processes} interpreters on {n_cores} cores: each imports "
                f"torch (~{IMPORT_CPU_S} s of CPU, ~{IMPORT_MB} MB), ~{processes * IMPORT_CPU_S / n_cores:.0f} s "
                f"before the first round; {fix or 'fewer clients per launch, or more cores'}")
    return None
