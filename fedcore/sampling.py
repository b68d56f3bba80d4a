"""Client samplers: which idle clients the server asks to train next."""
from __future__ import annotations

import numpy as np

from fedcore.registry import samplers

__all__ = ["Sampler", "UniformSampler"]


class Sampler:
    """Picks `k` clients among the `candidates` (idle clients), seeded by the run."""

    def __init__(self, client_ids: list[int], seed: int, timing=None):
        self.client_ids = list(client_ids)
        self.rng = np.random.default_rng(seed + 3)
        self.timing = timing

    def sample(self, k: int, candidates: list[int]) -> list[int]:
        raise NotImplementedError


@samplers.register("uniform")
class UniformSampler(Sampler):
    """Uniformly at random without replacement, returned in id order."""

    def sample(self, k: int, candidates: list[int]) -> list[int]:
        candidates = sorted(candidates)
        k = min(k, len(candidates))
        picked = self.rng.choice(len(candidates), size=k, replace=False)
        return sorted(candidates[i] for i in picked)
