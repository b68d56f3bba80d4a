"""Running one trial's course: in this process, or as `python -m fedcore.run` in another.

Everything a tuner learns about a course it reads back from the run's own
outputs (metrics.jsonl, summary.json), so both ways give the same records and
nothing crosses a process boundary but a command line and JSON files.
`_run_course` is the one place that starts a course in this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterator

from fedcore.kernel.errors import EXIT_DIVERGED, ConfigError, CourseDiverged
from fedcore.kernel.files import make_folder, open_fresh

__all__ = ["CourseRun", "Job", "run_jobs", "read_run"]


@dataclass
class CourseRun:
    """What a finished course left in its outdir."""

    records: list[dict[str, Any]]
    summary: dict[str, Any]
    outdir: Path
    error: str | None = None
    diverged: str | None = None      # the one line of a course that stopped as diverged


@dataclass
class Job:
    """One course to run: the base config, the trial's dotted overrides, where it writes."""

    base: Path
    overrides: dict[str, Any]
    outdir: Path

    def argv(self) -> list[str]:
        # JSON is YAML: every value reaches the config exactly as typed
        return [f"{k}={json.dumps(v)}" for k, v in self.overrides.items()] + [f"outdir={self.outdir}"]


def read_run(outdir: Path) -> CourseRun:
    """Records and summary of a finished run (metrics.jsonl, summary.json)."""
    outdir = Path(outdir)
    lines = (outdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    summary = json.loads((outdir / "summary.json").read_text())
    return CourseRun(records, summary, outdir)


def _run_course(job: Job) -> CourseRun:
    """Run one course in this process through the Python API, quietly, and read back its
    outputs: a promoted trial's metrics.jsonl holds its rounds from before the checkpoint too."""
    import fedcore
    fedcore.run([job.base, {**job.overrides, "outdir": str(job.outdir), "verbose": 0}])
    return read_run(job.outdir)


def _run_subprocess(job: Job, threads: int) -> CourseRun:
    """Run one course as `python -m fedcore.run` (trials in parallel, one process each, that
    share the cores: OMP_NUM_THREADS bounds what `torch_threads: auto` takes)."""
    make_folder(job.outdir)
    cmd = [sys.executable, "-m", "fedcore.run", "--cfg", str(job.base), *job.argv()]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(threads)}
    with open_fresh(job.outdir / "stderr.txt") as err:
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    if proc.returncode != 0:
        lines = (job.outdir / "stderr.txt").read_text().strip().splitlines()
        cause = next((ln for ln in lines if ln.startswith("fedcore:")), lines[-1] if lines else "")
        if proc.returncode == EXIT_DIVERGED:
            return _diverged(job, cause.removeprefix("fedcore: "))
        if proc.returncode == 2:
            raise ConfigError(cause.removeprefix("fedcore: "))
        return CourseRun([], {}, job.outdir, f"exit {proc.returncode}: {cause}")
    return read_run(job.outdir)


def _diverged(job: Job, why: str) -> CourseRun:
    """A course that stopped as diverged left its finite rounds' records: they are its result."""
    run = read_run(job.outdir)
    run.diverged = why
    return run


def _guarded(run, job: Job) -> CourseRun:
    try:
        return run(job)
    except ConfigError:
        raise  # the base config or the space is wrong: every trial would fail the same way
    except CourseDiverged as exc:
        return _diverged(job, str(exc))
    except Exception as exc:  # one failed trial does not end the study (the error is in its row)
        return CourseRun([], {}, job.outdir, f"{type(exc).__name__}: {exc}")


def run_jobs(jobs: list[Job], parallel: int = 1) -> Iterator[CourseRun]:
    """Run `jobs` (in this process when `parallel` is 1, else that many processes at once);
    yields their results in the order of `jobs`, each as soon as it and those before it end."""
    if parallel <= 1 or len(jobs) <= 1:
        for j in jobs:
            yield _guarded(_run_course, j)
        return
    from fedcore.execution.executor import usable_cores
    run = partial(_run_subprocess, threads=max(1, usable_cores() // parallel))
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        yield from pool.map(lambda j: _guarded(run, j), jobs)
