"""Privacy accounting for the subsampled Gaussian mechanism with Rényi DP.

One step releases `f(D) + N(0, sigma^2)` (sensitivity 1) on a batch where
each record is included with probability `q`. Its Rényi divergence of
order alpha is `log(A_alpha) / (alpha - 1)` with (Mironov, Talwar and Zhang,
"Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019)

    A_alpha = E_{z ~ N(0, s^2)} [ (1 - q + q * exp((2z - 1) / (2 s^2)))^alpha ].

For integer alpha the binomial expansion gives the closed form

    A_alpha = sum_k C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 s^2)),

the bound behind the moments accountant of Abadi et al. (2016). Fractional
orders are computed by integrating the definition numerically. RDP adds up
over steps; the total is converted to (epsilon, delta)-DP with either the
classic bound (Mironov 2017, Prop. 3) or the tighter one of Balle et al.
(2020) / Canonne, Kamath and Steinke (2020).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

__all__ = ["DEFAULT_ORDERS", "rdp_sampled_gaussian", "rdp_to_dp", "dp_epsilon", "RdpAccountant"]

DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1.0 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512])


def _log_add(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    hi, lo = (a, b) if a > b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha for an integer order, by the binomial expansion (log space)."""
    log_a = -math.inf
    for k in range(alpha + 1):
        log_binom = math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
        term = (log_binom + k * math.log(q) + (alpha - k) * math.log1p(-q)
                + (k * k - k) / (2 * sigma * sigma))
        log_a = _log_add(log_a, term)
    return log_a


def _log_a_numeric(q: float, sigma: float, alpha: float, per_sigma: int = 200) -> float:
    """log A_alpha for any real order > 1, integrating the definition on a fine grid
    (`per_sigma` points per standard deviation; the integrand is smooth and Gaussian-tailed,
    so the trapezoid rule is accurate far beyond what the conversion needs)."""
    lo = -12.0 * sigma - 1.0
    hi = max(alpha, 1.0) + 12.0 * sigma + 1.0
    z = np.linspace(lo, hi, int((hi - lo) / sigma * per_sigma) + 1)
    log_mu0 = -z * z / (2 * sigma * sigma) - math.log(sigma * math.sqrt(2 * math.pi))
    # log(1 - q + q exp(t)) computed stably
    t = (2 * z - 1) / (2 * sigma * sigma)
    log_mix = np.logaddexp(math.log1p(-q), math.log(q) + t)
    log_f = log_mu0 + alpha * log_mix
    m = log_f.max()
    integral = np.trapezoid(np.exp(log_f - m), z)
    return float(m + math.log(integral))


def rdp_sampled_gaussian(q: float, sigma: float, steps: int,
                         orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP epsilon at each order after `steps` compositions (noise multiplier `sigma`)."""
    if not 0 <= q <= 1:
        raise ValueError(f"sampling rate q={q} must be in [0, 1]")
    if sigma <= 0:
        raise ValueError(f"noise multiplier sigma={sigma} must be > 0 for a finite epsilon")
    out = []
    for a in orders:
        if a <= 1:
            raise ValueError(f"RDP order {a} must be > 1")
        if q == 0:
            rdp = 0.0
        elif q == 1.0:
            rdp = a / (2 * sigma * sigma)  # the plain Gaussian mechanism
        elif float(a).is_integer():
            rdp = _log_a_int(q, sigma, int(a)) / (a - 1)
        else:
            rdp = _log_a_numeric(q, sigma, float(a)) / (a - 1)
        out.append(rdp * steps)
    return np.array(out)


def rdp_to_dp(orders: Sequence[float], rdp: Iterable[float], delta: float,
              conversion: str = "improved") -> tuple[float, float]:
    """(epsilon, best order) for a target `delta` from RDP values at `orders`."""
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must be in (0, 1)")
    best, best_order = math.inf, None
    for a, r in zip(orders, rdp):
        if conversion == "classic":
            eps = float(r) + math.log(1 / delta) / (a - 1)
        elif conversion == "improved":
            eps = float(r) + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
        else:
            raise ValueError(f"unknown conversion '{conversion}' (classic or improved)")
        if eps < best:
            best, best_order = eps, a
    return max(float(best), 0.0), best_order


def dp_epsilon(q: float, sigma: float, steps: int, delta: float,
               orders: Sequence[float] = DEFAULT_ORDERS, conversion: str = "improved") -> float:
    """Epsilon spent by `steps` subsampled Gaussian steps at the given `delta`."""
    return rdp_to_dp(orders, rdp_sampled_gaussian(q, sigma, steps, orders), delta, conversion)[0]


@dataclass
class RdpAccountant:
    """Accumulates RDP over (possibly changing) steps; reports epsilon at `delta`."""

    orders: tuple[float, ...] = DEFAULT_ORDERS

    def __post_init__(self) -> None:
        self._rdp = np.zeros(len(self.orders))
        self._cache: dict[tuple[float, float], np.ndarray] = {}
        self.steps = 0

    def step(self, q: float, sigma: float, n: int = 1) -> None:
        """Record `n` steps with sampling rate `q` and noise multiplier `sigma`."""
        key = (q, sigma)
        if key not in self._cache:
            self._cache[key] = rdp_sampled_gaussian(q, sigma, 1, self.orders)
        self._rdp = self._rdp + n * self._cache[key]
        self.steps += n

    def epsilon(self, delta: float, conversion: str = "improved") -> float:
        if self.steps == 0:
            return 0.0
        return rdp_to_dp(self.orders, self._rdp, delta, conversion)[0]
