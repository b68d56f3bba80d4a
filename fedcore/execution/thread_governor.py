"""`torch_threads: auto` keeps several intra-op threads only while they measure faster.

A step large enough to share (executor.AUTO_THREADS_MFLOP) is given every usable core when
the course is built; whether the cores are really there is known only by running: other
work on the machine deschedules one thread while its peers wait for it at each of the
step's barriers. So a sequential course times its fits: each takes some seconds per unit
of work (`FitResult.work`, samples through forward and backward) with several threads or
with one, and the next fits run with the count whose recent rate is lower. Several threads
must win by `MARGIN` (a tie takes one: the same speed for a core less). Now and then a fit
runs with the other count (a probe), so that a change in the machine's load is seen; a probe
costs what the other count is slower by, which beside a busy neighbour can be 2.5 fits (two
threads waiting for a descheduled peer at each of a small step's barriers). So probes are
spaced to cost at most `PROBE_SHARE` of the fits' time: the other count's measured excess over
`PROBE_SHARE` fits apart, but at least `PROBE_EVERY` and at most `PROBE_MOST` (a change of
load that favours the count not chosen is seen within that many fits; one that slows the
chosen count, at once). A count's rate is the mean of its last measurement and its previous
rate (recent load counts most); the first fit, which pays the process's warm-up, is not
measured.

Intra-op threads split a step's sums, so a fit's last bits depend on its thread count
(~1e-7 relative, float32): a course whose thread count follows the load is reproducible to
that rounding; a number for `torch_threads` makes it bit for bit.
"""
from __future__ import annotations

import logging
import math
from time import perf_counter

from fedcore.kernel.hooks import Wrapper

__all__ = ["ThreadGovernor", "govern_threads"]

log = logging.getLogger("fedcore.executor")


class ThreadGovernor:
    """Chooses, fit by fit, between `most` intra-op threads and one from measured rates."""

    MARGIN = 0.95       # several threads are kept only where at least 5% faster per unit of work
    PROBE_EVERY = 8     # fits between two probes of the count not chosen, at least
    PROBE_MOST = 256    # and at most
    PROBE_SHARE = 0.01  # the share of the fits' time the probes may cost

    def __init__(self, most: int, probe_every: int = PROBE_EVERY) -> None:
        if most < 2:
            raise ValueError(f"a thread governor chooses between several threads and one, got {most}")
        self.most, self.probe_every = most, probe_every
        self.rate: dict[int, float] = {}    # seconds per unit of work, by thread count
        self.fits = 0                       # fits recorded (the first is not measured)
        self.probed = 2                     # the fit that last ran with the count not chosen
        self.fits_by_count = {most: 0, 1: 0}

    def best(self) -> int:
        """The count the next ordinary fit runs with."""
        if self.most not in self.rate or 1 not in self.rate:
            return self.most
        return self.most if self.rate[self.most] < self.MARGIN * self.rate[1] else 1

    def interval(self) -> int:
        """Fits from one probe to the next: the other count's excess time per fit over
        PROBE_SHARE, within [probe_every, PROBE_MOST]."""
        best = self.best()
        other = 1 if best == self.most else self.most
        excess = self.rate[other] / self.rate[best] - 1 if self.rate[best] > 0 else 0.0
        return min(self.PROBE_MOST, max(self.probe_every, math.ceil(max(excess, 0.0) / self.PROBE_SHARE)))

    def choose(self) -> int:
        """The count the next fit runs with: each count is measured once first, then the best,
        and the other once `interval()` fits have passed since it last ran."""
        if self.fits == 0:
            return self.most                     # warm-up, not measured
        for n in (self.most, 1):
            if n not in self.rate:
                return n
        best = self.best()
        if self.fits - self.probed >= self.interval():
            self.probed = self.fits
            return 1 if best == self.most else self.most
        return best

    def record(self, threads: int, seconds: float, work: float) -> None:
        """A fit that ran with `threads` threads took `seconds` for `work` units of work."""
        self.fits += 1
        self.fits_by_count[threads] = self.fits_by_count.get(threads, 0) + 1
        if self.fits == 1 or work <= 0 or threads not in (self.most, 1):
            return
        before = self.best() if len(self.rate) == 2 else None
        rate = seconds / work
        old = self.rate.get(threads)
        self.rate[threads] = rate if old is None else (old + rate) / 2
        after = self.best() if len(self.rate) == 2 else None
        if after is not None and after != before:
            log.info("torch_threads auto: %d thread%s from now (%.3g ms per sample with %d threads, "
                     "%.3g with one)", after, "s" if after > 1 else "", self.rate[self.most] * 1e3,
                     self.most, self.rate[1] * 1e3)


def govern_threads(trainer, most: int) -> ThreadGovernor:
    """Time each of `trainer`'s fits and run it with the thread count its governor chooses (a
    wrapper outside every other, so the whole fit is timed). A batched result (the vectorized
    engine trained a stack of clients at once) passes through unmeasured."""
    import torch
    governor = ThreadGovernor(most)

    def timed_fit(fit, *args):
        n = governor.choose()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        start = perf_counter()
        result = fit(*args)
        governor.record(n, perf_counter() - start, float(getattr(result, "work", 0.0) or 0.0))
        return result

    def passed(fit, *args):
        return fit(*args)
    trainer.wrap(Wrapper("thread governor", "fit", timed_fit, per_client_result=True,
                         process_safe=True, around_result=passed))
    trainer.thread_governor = governor
    return governor
