"""Which accountant turns a course's Gaussian releases into (epsilon, delta): RDP, PLD or PRV.

Every accountant here composes the same mechanism, a Gaussian of noise multiplier sigma on a
sum of sensitivity 1, applied to a Poisson sample of rate q (q = 1: no sampling), and
reports the epsilon spent at a delta. They differ in how tightly they compose:

- `rdp`: Rényi DP (`dp_accountant.py`, equal to Opacus's and to dp-accounting's analysis);
- `pld`: privacy loss distributions, composed by FFT (dp-accounting's `PLDAccountant`,
  Meiser and Mohammadi 2018, Koskela et al. 2020, Doroshenko et al. 2022). The pessimistic
  discretization (the library's default) keeps it an upper bound whatever the grid;
- `prv`: privacy random variables (Gopi, Lee and Wutschitz, NeurIPS 2021), Microsoft's
  `prv-accountant`; the upper end of its error interval is reported.

PLD and PRV are exact up to their numerical error, so for the same course they report a
smaller epsilon than RDP, whose conversion to (epsilon, delta) is lossy. Both libraries come
with the `privacy` extra; the course refuses `pld` or `prv` in one line when it is missing.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Protocol

import numpy as np

from fedcore.algorithms.dp_accountant import RdpAccountant as _Rdp
from fedcore.kernel.config import declare, positive, resolver, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.schema import clients_per_round

__all__ = ["ACCOUNTANTS", "Accountant", "RdpLedger", "PldAccountant", "PrvAccountant",
           "make_accountant", "epsilon_for", "calibrate_sigma"]

ACCOUNTANTS = ("rdp", "pld", "prv")
PLD_INTERVAL = 1e-3   # the privacy-loss grid: pessimistic, so coarser only loosens the bound
PRV_EPS_ERROR = 1e-2  # the PRV's error in epsilon; its upper end is what is reported

declare("privacy.dp.accountant", str, "rdp", "how the epsilon spent is computed: rdp (Rényi DP, "
        "Opacus's analysis), pld (privacy loss distributions, Google's dp-accounting) or prv "
        "(privacy random variables, Microsoft's prv-accountant); pld and prv are tighter and "
        "need the privacy extra", choices=ACCOUNTANTS)

declare("privacy.dp.target_epsilon", float, None, "central, ftrl: the epsilon (at "
        "privacy.dp.delta) the whole course may spend; when set, privacy.dp.noise_multiplier is "
        "replaced by the least multiplier that meets it, computed by privacy.dp.accountant",
        check=positive)

_PACKAGES = {"pld": ("dp_accounting", "dp-accounting"), "prv": ("prv_accountant", "prv-accountant")}


@validator
def _check_accountant(cfg) -> None:
    kind = cfg["privacy.dp.accountant"]
    if cfg["privacy.dp.mode"] == "none" or kind not in _PACKAGES:
        return
    module, package = _PACKAGES[kind]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"privacy.dp.accountant: {kind} needs the {package} package; "
                          f"pip install 'fedcore[privacy]' or use privacy.dp.accountant=rdp")


class Accountant(Protocol):
    steps: int

    def step(self, q: float, sigma: float, n: int = 1) -> None: ...
    def epsilon(self, delta: float) -> float: ...
    def state(self) -> dict[str, Any]: ...
    def restore(self, state: dict[str, Any]) -> None: ...


class RdpLedger(_Rdp):
    """The RDP accountant with the checkpoint state the course has always written."""

    def state(self) -> dict[str, Any]:
        return {"rdp": [float(r) for r in self._rdp], "steps": self.steps}

    def restore(self, state: dict[str, Any]) -> None:
        self._rdp = np.array(state["rdp"], dtype=float)
        self.steps = int(state["steps"])


class _Segments:
    """Runs of equal steps [(q, sigma, n), ...]: what PLD and PRV recompose from."""

    def __init__(self) -> None:
        self.segments: list[list[float]] = []
        self.steps = 0

    def step(self, q: float, sigma: float, n: int = 1) -> None:
        if not 0 <= q <= 1 or sigma <= 0:
            raise ValueError(f"q={q} must be in [0, 1] and sigma={sigma} > 0")
        if self.segments and self.segments[-1][:2] == [q, sigma]:
            self.segments[-1][2] += n
        else:
            self.segments.append([q, sigma, n])
        self.steps += n
        self._stepped(q, sigma, n)

    def _stepped(self, q: float, sigma: float, n: int) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"segments": [[float(q), float(s), int(n)] for q, s, n in self.segments]}

    def restore(self, state: dict[str, Any]) -> None:
        self.__init__()
        for q, s, n in state["segments"]:
            self.step(float(q), float(s), int(n))


class PldAccountant(_Segments):
    """dp-accounting's PLD accountant (add/remove neighbours), composed as steps arrive."""

    def __init__(self) -> None:
        from dp_accounting import pld
        super().__init__()
        self._acc = pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)

    def _stepped(self, q: float, sigma: float, n: int) -> None:
        import dp_accounting
        event = dp_accounting.GaussianDpEvent(sigma)
        if q < 1:
            event = dp_accounting.PoissonSampledDpEvent(q, event)
        self._acc.compose(event, n)

    def epsilon(self, delta: float) -> float:
        return 0.0 if self.steps == 0 else max(float(self._acc.get_epsilon(delta)), 0.0)


class PrvAccountant(_Segments):
    """Microsoft's PRV accountant; epsilon is the upper end of its error interval."""

    def epsilon(self, delta: float) -> float:
        if self.steps == 0:
            return 0.0
        from prv_accountant import PRVAccountant
        from prv_accountant.privacy_random_variables import (GaussianMechanism,
                                                             PoissonSubsampledGaussianMechanism)
        prvs = [GaussianMechanism(noise_multiplier=s) if q == 1 else
                PoissonSubsampledGaussianMechanism(noise_multiplier=s, sampling_probability=q)
                for q, s, _ in self.segments]
        counts = [int(n) for _, _, n in self.segments]
        acc = PRVAccountant(prvs=prvs, max_self_compositions=counts, eps_error=PRV_EPS_ERROR,
                            delta_error=delta / 1000)
        return max(float(acc.compute_epsilon(delta=delta, num_self_compositions=counts)[2]), 0.0)


def make_accountant(kind: str) -> Accountant:
    """An empty accountant of `kind` (rdp, pld or prv)."""
    if kind == "rdp":
        return RdpLedger()
    if kind == "pld":
        return PldAccountant()
    if kind == "prv":
        return PrvAccountant()
    raise ValueError(f"unknown accountant '{kind}' ({', '.join(ACCOUNTANTS)})")


def epsilon_for(kind: str, q: float, sigma: float, steps: int, delta: float) -> float:
    """Epsilon of `steps` Gaussian releases (rate q, multiplier sigma) by accountant `kind`."""
    acc = make_accountant(kind)
    acc.step(q, sigma, steps)
    return acc.epsilon(delta)


SIGMA_MAX = 1e3   # a noise 1000 times the sensitivity: past it a target is called unreachable


def calibrate_sigma(kind: str, q: float, steps: int, delta: float, target: float,
                    key: str = "privacy.dp.target_epsilon", rel: float = 1e-3) -> float:
    """The least sigma (to `rel`) whose `steps` releases spend at most `target` epsilon, by
    bisection on the accountant itself; a ConfigError naming `key` when even SIGMA_MAX
    spends more."""
    spent = lambda s: epsilon_for(kind, q, s, steps, delta)  # noqa: E731
    top = spent(SIGMA_MAX)
    if top > target:
        raise ConfigError(f"{key}: epsilon {target:g} at delta {delta:g} cannot be met in {steps} "
                          f"releases (even noise multiplier {SIGMA_MAX:g} spends {top:.4g}); raise "
                          f"the target or delta, or lower the rounds")
    lo, hi = 0.0, 1.0
    while spent(hi) > target:
        lo, hi = hi, hi * 2
    while hi - lo > rel * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if spent(mid) > target else (lo, mid)
    return hi


@resolver
def _calibrate(values: dict) -> None:
    """privacy.dp.target_epsilon -> privacy.dp.noise_multiplier, for the course's releases:
    central, one Poisson step of rate k/N a round; ftrl, one Gaussian mechanism (its
    multiplier is relative to the factorization's sensitivity)."""
    target, mode = values["privacy.dp.target_epsilon"], values["privacy.dp.mode"]
    if target is None or mode == "none":
        return
    if mode == "local":
        raise ConfigError("privacy.dp.target_epsilon: a local DP client's releases are counted "
                          "as they reach the server, not known in advance; set "
                          "privacy.dp.noise_multiplier instead")
    kind = values["privacy.dp.accountant"]
    if kind in _PACKAGES and importlib.util.find_spec(_PACKAGES[kind][0]) is None:
        return   # the accountant's own check names the missing package
    if mode == "ftrl":
        q, steps = 1.0, 1
    else:
        q, steps = clients_per_round(values) / values["federate.client_num"], values["federate.total_round_num"]
    values["privacy.dp.noise_multiplier"] = calibrate_sigma(kind, min(q, 1.0), steps,
                                                           values["privacy.dp.delta"], target)
