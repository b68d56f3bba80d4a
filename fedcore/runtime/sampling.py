"""Client samplers: which idle clients the server asks to train next."""
from __future__ import annotations

import secrets

import numpy as np

from fedcore.kernel.registry import samplers

__all__ = ["Sampler", "UniformSampler", "PoissonSampler"]


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


class PoissonSampler(Sampler):
    """Each candidate independently with probability `rate`, returned in id order: the
    sampling the subsampled-Gaussian privacy bound assumes (the cohort size varies, and
    may be 0). With `secret` the coin flips come from the OS, so that no one holding the
    course config can tell who was sampled (the bound's amplification needs that)."""

    def __init__(self, client_ids: list[int], seed: int, timing=None, rate: float = 1.0,
                 secret: bool = False):
        super().__init__(client_ids, seed, timing)
        self.rate, self.secret = rate, secret

    def sample(self, k: int, candidates: list[int]) -> list[int]:
        """Ignores `k`: the expected cohort is `rate` times the candidates."""
        candidates = sorted(candidates)
        if self.secret:
            coin = secrets.SystemRandom()
            return [c for c in candidates if coin.random() < self.rate]
        flips = self.rng.random(len(candidates))
        return [c for c, u in zip(candidates, flips) if u < self.rate]
