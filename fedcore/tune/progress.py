"""A study's progress on stderr, so that hours of trials are never silent.

A run is one trial at one budget (successive halving and Hyperband continue a
promoted trial at a larger budget: one more run). After each run: on a
terminal one line rewritten in place, elsewhere (a log file, CI, `nohup`) one
line per finished run. Each says the runs done of those planned, the best
objective so far, the wall time elapsed and an estimate of what remains (the
mean time of the runs so far times the runs left: rough where budgets differ).
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

from fedcore.runtime.progress import duration_text

__all__ = ["StudyProgress"]


class StudyProgress:
    """Counts planned and finished runs and shows them; methods announce runs with `expect`."""

    def __init__(self, metric: str, stream: TextIO | None = None, terminal: bool | None = None):
        self.metric = metric
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.planned = self.done = self.ran = 0
        self.t0 = time.perf_counter()

    def expect(self, runs: int) -> None:
        self.planned += runs

    def finished(self, row, best, cached: bool = False) -> None:
        """A run ended (`cached`: recorded by an earlier session, not run now); `best` is the
        study's best row so far."""
        self.done += 1
        self.planned = max(self.planned, self.done)
        if cached:
            return
        self.ran += 1
        elapsed = time.perf_counter() - self.t0
        left = elapsed / self.ran * (self.planned - self.done)
        outcome = (f"{self.metric} {row.objective:.4g}" if row.status == "complete" and row.objective is not None
                   else row.status)
        best_s = (f"best {self.metric} {best.objective:.4g} (trial {best.trial})"
                  if best is not None and best.objective is not None else "no best yet")
        line = (f"tune: {self.done}/{self.planned} runs  trial {row.trial} at {row.budget:g}: {outcome}  "
                f"{best_s}  elapsed {duration_text(elapsed)}  left ~{duration_text(left)}")
        if self.terminal:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.terminal and self.ran:
            self.stream.write("\n")
            self.stream.flush()
