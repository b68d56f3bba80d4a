"""One event queue for every message and timer of every worker.

Entries are ordered by `(time, priority, seq)`: the sequence number makes ties
deterministic, so the same seed gives the same event order. `Scheduler` is the
virtual clock (it jumps to the next event); `WallClockScheduler` overrides
only how it waits, sleeping until an event is due, so handlers never know
which clock they run on.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time as _time
from typing import Callable

__all__ = ["Scheduler", "WallClockScheduler", "ImmediateScheduler", "PRIORITY_TIMER", "PRIORITY_MESSAGE", "HandlerError"]

# Lower runs first at equal time: a timer due at t fires before messages arriving at t.
PRIORITY_TIMER = 0
PRIORITY_MESSAGE = 1


class HandlerError(RuntimeError):
    """A handler raised: names the event, the worker and the round."""


class Scheduler:
    """Discrete-event loop in virtual time."""

    def __init__(self) -> None:
        self._queue: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.processed = 0
        self._stopped = False

    def schedule(self, time: float, priority: int, action: Callable[[], None]) -> None:
        """Run `action()` at `time`; an event in the past runs at the current time."""
        if time < self.now:
            time = self.now
        heapq.heappush(self._queue, (time, priority, next(self._seq), action))

    def stop(self) -> None:
        """Finish after the event being processed; the rest of the queue is dropped."""
        self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    def pending(self) -> int:
        return len(self._queue)

    def _next(self):
        """Pop the next due entry, or None when there is nothing left to run."""
        if not self._queue:
            return None
        return heapq.heappop(self._queue)

    def run(self, until: float | None = None) -> None:
        """Process events in order until the queue is empty, `stop()` or `until`."""
        pop = self._next
        queue = self._queue
        # the virtual clock's `_next` is a plain pop from the heap: done here, without the call
        direct = type(self)._next is Scheduler._next
        heappop = heapq.heappop
        while not self._stopped:
            if direct:
                if not queue:
                    break
                entry = heappop(queue)
            else:
                entry = pop()
                if entry is None:
                    break
            t = entry[0]
            if until is not None and t > until:
                heapq.heappush(self._queue, entry)
                self.now = until
                break
            self.now = t
            entry[3]()
            self.processed += 1


class WallClockScheduler(Scheduler):
    """The same queue in real seconds since start; thread-safe `schedule` for I/O threads."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition()
        self._t0 = _time.monotonic()
        self._idle_exit = False

    @property
    def clock(self) -> float:
        return _time.monotonic() - self._t0

    def schedule(self, time: float, priority: int, action: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._queue, (max(time, 0.0), priority, next(self._seq), action))
            self._cond.notify()

    def continue_from(self, seconds: float) -> None:
        """Read `seconds` now, the events already queued moved alike: a resumed course's
        clock goes on from its snapshot's time instead of starting again at 0."""
        with self._cond:
            shift = seconds - self.clock
            self._t0 -= shift
            self._queue[:] = [(t + shift, *rest) for t, *rest in self._queue]
            heapq.heapify(self._queue)
            self._cond.notify()

    def call_soon(self, action: Callable[[], None], priority: int = PRIORITY_MESSAGE) -> None:
        """Schedule `action` now (from any thread), e.g. for a message just received."""
        self.schedule(self.clock, priority, action)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def exit_when_idle(self) -> None:
        """Let `run` return once the queue is empty instead of waiting for more events."""
        with self._cond:
            self._idle_exit = True
            self._cond.notify()

    def _next(self):
        with self._cond:
            while not self._stopped:
                if self._queue:
                    delay = self._queue[0][0] - self.clock
                    if delay <= 0:
                        entry = heapq.heappop(self._queue)
                        return (max(entry[0], self.clock),) + entry[1:]
                    self._cond.wait(delay)  # sleeps: an idle process uses no CPU
                elif self._idle_exit:
                    return None
                else:
                    self._cond.wait()
            return None


class ImmediateScheduler:
    """Runs each action at once on the thread that schedules it: no queue, no clock.

    For driving a communicator without a course (wire benchmarks, transport tests).
    """

    now = 0.0

    def call_soon(self, action: Callable[[], None], priority: int = PRIORITY_MESSAGE) -> None:
        action()

    def stop(self) -> None:
        pass
