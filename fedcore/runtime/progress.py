"""Progress on stderr: a bar on a terminal, a periodic one-line round log anywhere else.

A terminal gets a tqdm bar (rounds done, wall time, rate and ETA, with the
latest virtual time and test accuracy); a log file, CI, `nohup` or a notebook
gets one line every `progress.interval` seconds and at the last round, so a
long run is never silent until it ends. `verbose: 2` prints every round.
A deployed course's clock is the wall clock, so its lines show no virtual time:
`wall` is then the course's own clock, seconds since its server started.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from fedcore.runtime.monitor import Callback

__all__ = ["Progress", "make_progress", "duration_text"]


def duration_text(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress(Callback):
    """Shows rounds as their records are written; `bar=False` writes lines instead."""

    def __init__(self, total_rounds: int, *, bar: bool, every_round: bool = False,
                 interval: float = 30.0, stream: TextIO | None = None, wall_clock: bool = False):
        self.total = total_rounds
        self.wall_clock = wall_clock   # the record's time is wall-clock seconds (deployment)
        self.use_bar = bar
        self.every_round = every_round
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self.bar = None
        self.t0 = self.last_line = time.perf_counter()
        self.first_round: int | None = None

    def on_start(self, monitor) -> None:
        self.t0 = self.last_line = time.perf_counter()
        if self.use_bar:
            from tqdm import tqdm
            try:   # a pseudo-terminal may report a 0 x 0 size, which would hide the bar
                size = os.get_terminal_size(self.stream.fileno())
                sized = size.columns > 0 and size.lines > 0
            except (AttributeError, OSError, ValueError):
                sized = False
            fixed = {} if sized else {"ncols": 100, "nrows": 20}
            self.bar = tqdm(total=self.total, unit="round", file=self.stream, dynamic_ncols=sized,
                            desc="fedcore", leave=True, **fixed)

    def on_record(self, record: dict[str, Any]) -> None:
        round_ = record["round"]
        if self.first_round is None:
            self.first_round = round_ - 1   # a resumed course starts past round 0
        acc = record.get("test_acc")
        if self.bar is not None:
            self.bar.update(round_ - self.bar.n)
            post = "" if self.wall_clock else f"virtual {record['virtual_time']:.1f}s "
            self.bar.set_postfix_str((post + (f"acc {acc:.4f}" if acc is not None else "")).strip())
            return
        now = time.perf_counter()
        if not (self.every_round or round_ >= self.total or now - self.last_line >= self.interval):
            return
        self.last_line = now
        wall = record["virtual_time"] if self.wall_clock else now - self.t0
        done = round_ - self.first_round
        eta = wall / done * (self.total - round_) if done > 0 and round_ < self.total else 0.0
        acc_s = f"  test_acc {acc:.4f}" if acc is not None else ""
        virtual = "" if self.wall_clock else f"virtual {record['virtual_time']:.1f}s  "
        self.stream.write(f"round {round_}/{self.total}  {virtual}"
                          f"wall {duration_text(wall)}  eta {duration_text(eta)}{acc_s}\n")
        self.stream.flush()

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def make_progress(level: int | bool, total_rounds: int, interval: float = 30.0,
                  stream: TextIO | None = None, wall_clock: bool = False) -> Progress | None:
    """The progress callback for a `verbose` level: none at 0, a bar on a terminal at 1,
    else periodic lines (every round at 2); `wall_clock` for a deployed course's records."""
    level = int(level)
    if level <= 0:
        return None
    stream = stream if stream is not None else sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    return Progress(total_rounds, bar=tty and level == 1, every_round=level >= 2,
                    interval=interval, stream=stream, wall_clock=wall_clock)
