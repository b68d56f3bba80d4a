"""Samplers that look at device speed: `responsiveness` and `group`.

Both rank clients by their modelled time for one round, T_i (download, the
round's local work, upload; from the time model). `responsiveness` samples
without replacement with probability proportional to T_i ** -power, so fast
devices are picked more often but slow ones still get a turn; `group` bins
clients by T_i into equal-size groups and takes the groups in turn, so each
aggregation mixes devices of similar speed (less staleness within a round)
while every speed class is visited.

`configure(course)` (called when the course is built) reads the sampler's
keys and calibrates T_i with each client's local work per round and the
model's size on the wire; until then a nominal round (1000 gradient
evaluations, 100 kB each way) ranks the devices.
"""
from __future__ import annotations

import numpy as np

from fedcore.kernel.config import declare, non_negative, positive
from fedcore.kernel.registry import samplers
from fedcore.runtime.sampling import Sampler

__all__ = ["SpeedAwareSampler", "ResponsivenessSampler", "GroupSampler"]

declare("federate.sampler_power", float, 1.0, "responsiveness sampler: probability proportional to "
        "(modelled round time) ** -power", check=non_negative)
declare("federate.sampler_groups", int, 5, "group sampler: number of speed groups taken in turn",
        check=positive)


class SpeedAwareSampler(Sampler):
    """Knows each client's modelled round time T_i."""

    def __init__(self, client_ids: list[int], seed: int, timing=None):
        super().__init__(client_ids, seed, timing)
        self.round_time: dict[int, float] = {}
        self.calibrate({c: 1000.0 for c in self.client_ids}, 100_000)

    def configure(self, course) -> None:
        """Read this sampler's keys and rank devices by the course's actual round."""
        from fedcore.wire.serialization import encoded_size
        from fedcore.runtime.timing import expected_work
        self.power = course.cfg["federate.sampler_power"]
        self.num_groups = course.cfg["federate.sampler_groups"]
        work = {cid: expected_work(course, cid) for cid in self.client_ids}
        self.calibrate(work, encoded_size(course.server.aggregator.broadcast(1)))

    def calibrate(self, work: dict[int, float], nbytes: int) -> None:
        """Rank devices by the modelled time of one round of `work[cid]` and `nbytes` each way."""
        if self.timing is None:
            self.round_time = {c: 1.0 for c in self.client_ids}
        else:
            self.round_time = {c: self.timing.round_trip_time(c, work.get(c, 1000.0), nbytes)
                               for c in self.client_ids}
        self._calibrated()

    def _calibrated(self) -> None:
        pass


@samplers.register("responsiveness")
class ResponsivenessSampler(SpeedAwareSampler):
    """Without replacement, P(i) proportional to T_i ** -power; returned in id order."""

    power = 1.0

    def sample(self, k: int, candidates: list[int]) -> list[int]:
        candidates = sorted(candidates)
        k = min(k, len(candidates))
        if k == 0:
            return []
        score = np.array([self.round_time[c] ** -self.power for c in candidates])
        picked = self.rng.choice(len(candidates), size=k, replace=False, p=score / score.sum())
        return sorted(candidates[i] for i in picked)


@samplers.register("group")
class GroupSampler(SpeedAwareSampler):
    """Clients binned by T_i (fastest first); each call draws from the next group in turn,
    spilling into the following groups when the current one has too few idle clients."""

    num_groups = 5

    def _calibrated(self) -> None:
        ranked = sorted(self.client_ids, key=lambda c: (self.round_time[c], c))
        g = min(self.num_groups, len(ranked))
        self.groups = [set(int(c) for c in part) for part in np.array_split(np.array(ranked), g)]
        self.turn = 0

    def sample(self, k: int, candidates: list[int]) -> list[int]:
        idle = set(candidates)
        picked: list[int] = []
        for step in range(len(self.groups)):
            if len(picked) >= k:
                break
            group = sorted(self.groups[(self.turn + step) % len(self.groups)] & idle)
            take = min(k - len(picked), len(group))
            if take:
                picked += [group[i] for i in self.rng.choice(len(group), size=take, replace=False)]
        self.turn = (self.turn + 1) % len(self.groups)
        return sorted(picked)
