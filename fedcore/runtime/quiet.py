"""Log lines a peer can provoke at will, counted by kind and written now and then.

A hostile or broken participant can repeat a refused message, a reconnect or a
loss as often as it likes; one line per occurrence would let it flood the log.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter

__all__ = ["QuietLog", "LOG_EVERY"]

LOG_EVERY = 10.0  # seconds between two log lines of the same kind


class QuietLog:
    """Counts events by kind and logs each kind at most once every `every` seconds, with the
    number suppressed since its last line."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY):
        self.logger, self.every = logger, every
        self.counts: Counter[str] = Counter()
        self._last: dict[str, float] = {}
        self._quiet: Counter[str] = Counter()

    def __call__(self, kind: str, message: str, level: int = logging.WARNING) -> None:
        self.counts[kind] += 1
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < self.every:
            self._quiet[kind] += 1
            return
        more = self._quiet.pop(kind, 0)
        self._last[kind] = now
        self.logger.log(level, "%s%s", message, f" (and {more} more like it)" if more else "")
