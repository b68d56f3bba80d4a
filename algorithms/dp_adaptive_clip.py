"""Adaptive clipping for DP-FedAvg: the clip norm follows a quantile of the update norms.

Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning with Adaptive
Clipping" (NeurIPS 2021), Algorithm 1 with the geometric update. Each round, with C^t the
clip norm, m = qN the expected cohort, gamma = `target_quantile`, eta_C = `lr`,
sigma_b = `count_stddev` and z = `privacy.dp.noise_multiplier`:

    b_i     = 1 if ||Delta_i|| <= C^t else 0                  (before clipping)
    sigma_D = (z^-2 - (2 sigma_b)^-2)^(-1/2)                  (the update's share of z)
    Delta~  = (sum_i clip(Delta_i, C^t) + N(0, sigma_D^2 C^t^2 I)) / m
    b~      = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2  (the count of sensitivity 1/2)
    C^{t+1} = C^t exp(-eta_C (b~ - gamma))

The two releases together are one Gaussian mechanism of multiplier z (1/z^2 = 1/sigma_D^2 +
1/(2 sigma_b)^2), so the course's accountant steps (q, z) each round as without adaptation.
The server needs each norm before clipping, so the clients do not clip inside their steps.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from fedcore.algorithms.dp_fold import ClippedSum, FoldingRule
from fedcore.algorithms.dp_noise import standard_normal
from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.schema import clients_per_round

__all__ = ["update_share", "AdaptiveClip"]

declare("privacy.dp.adaptive_clip.target_quantile", float, None, "central: gamma, the quantile "
        "of the update norms the clip norm tracks (Andrew et al. 2021; privacy.dp.clip_norm is "
        "its first value); default: a fixed clip norm",
        check=lambda v: None if 0 < v < 1 else "must be in (0, 1)")
declare("privacy.dp.adaptive_clip.lr", float, 0.2, "central, adaptive clipping: eta_C of the "
        "geometric update C <- C exp(-eta_C (b - gamma))", check=positive)
declare("privacy.dp.adaptive_clip.count_stddev", float, None, "central, adaptive clipping: "
        "sigma_b, the std of the noise on the count of updates below C (default: the expected "
        "cohort / 20, the paper's choice); it takes its share of privacy.dp.noise_multiplier",
        check=lambda v: None if v >= 0 else "must be >= 0")


def count_stddev(cfg) -> float:
    """sigma_b as configured, or m / 20."""
    given = cfg["privacy.dp.adaptive_clip.count_stddev"]
    return given if given is not None else clients_per_round(cfg) / 20


def update_share(z: float, sigma_b: float) -> float:
    """sigma_D = (z^-2 - (2 sigma_b)^-2)^(-1/2): the multiplier left for the update (0 if z = 0)."""
    if z == 0:
        return 0.0
    if sigma_b == 0 or 2 * sigma_b <= z:
        raise ValueError(f"noise multiplier {z:g} cannot be split with count noise {sigma_b:g}: "
                         f"need 2 sigma_b > z")
    return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5


@validator
def _check_adaptive(cfg) -> None:
    if cfg["privacy.dp.adaptive_clip.target_quantile"] is None or cfg["privacy.dp.mode"] == "none":
        return
    if cfg["privacy.dp.mode"] != "central":
        raise ConfigError("privacy.dp.adaptive_clip.target_quantile: adaptive clipping is "
                          "DP-FedAvg's (privacy.dp.mode central); drop it or set the mode central")
    if cfg["privacy.dp.clip_each_step"]:
        raise ConfigError("privacy.dp.clip_each_step: adaptive clipping counts the updates whose "
                          "norm before clipping is below C, so the clients must not clip; set "
                          "privacy.dp.clip_each_step=false")
    if cfg["secure_aggregation.enabled"]:
        raise ConfigError("privacy.dp.adaptive_clip.target_quantile: under secure aggregation "
                          "the server sees no update's norm; drop one of them")
    z, sigma_b = cfg["privacy.dp.noise_multiplier"], count_stddev(cfg)
    try:
        update_share(z, sigma_b)
    except ValueError as e:
        raise ConfigError(f"privacy.dp.adaptive_clip.count_stddev: {e} (raise it above "
                          f"{z / 2:g} or lower privacy.dp.noise_multiplier)") from None


class AdaptiveClip(FoldingRule):
    """The server's clip norm and the combination rule that uses and updates it (folded one
    update at a time in a folding round, algorithms/dp_fold.py: the sum of the clipped deltas
    and the count of those below C are all it needs)."""

    def __init__(self, cfg, noise: Callable[[int], Any]) -> None:
        self.clip = cfg["privacy.dp.clip_norm"]
        self.gamma = cfg["privacy.dp.adaptive_clip.target_quantile"]
        self.eta = cfg["privacy.dp.adaptive_clip.lr"]
        self.sigma_b = count_stddev(cfg)
        self.sigma_d = update_share(cfg["privacy.dp.noise_multiplier"], self.sigma_b)
        self.m = clients_per_round(cfg)
        self.noise = noise      # round -> one source for the round's two draws

    def std(self) -> float:
        return self.sigma_d * self.clip

    def after(self, total: ClippedSum, source) -> dict[str, Any]:
        """Algorithm 1's count of the updates below C, noised, and C's geometric update."""
        C = self.clip
        count = total.below - total.present / 2
        if self.sigma_b > 0:
            count += self.sigma_b * standard_normal(1, source).item()
        estimate = count / self.m + 0.5
        self.clip = C * math.exp(-self.eta * (estimate - self.gamma))
        return {"dp_clipped": total.clipped, "dp_clip_norm": C, "dp_below_clip_estimate": estimate}

    rule = FoldingRule.__call__   # the noised mean of the clipped deltas (list form), then C's update

    def state(self) -> dict[str, Any]:
        return {"clip": float(self.clip)}

    def restore(self, state: dict[str, Any]) -> None:
        self.clip = float(state["clip"])

