"""Differential privacy for updates: clip each update's L2 norm, add Gaussian noise.

`privacy.dp.mode: local` is a client behaviour: each chosen client (all, a
list, or a fraction, as in the paper's experiment on the share of clients
adding noise) clips its delta to `clip_norm` C and adds N(0, (sigma C)^2) per
coordinate before sending. `central` is the server variant (DP-FedAvg,
McMahan et al., 2018): every delta is clipped to C, the clipped deltas are
averaged with equal weights and N(0, (sigma C)^2) / m is added to the mean of m.

The server keeps an RDP accountant (`dp_accountant`) and writes the
client-level epsilon spent at `privacy.dp.delta` into each round's record
(`dp_epsilon`) and the summary. Central: one subsampled Gaussian step per
round with q = clients per round / N. Local: each noisy release is a Gaussian
mechanism (q = 1) on that client's update; the epsilon of the client that
released most often is reported.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedcore import registry
from fedcore.algorithms.combine import Deltas, flatten, float_names, replace_combination, unflatten
from fedcore.algorithms.dp_accountant import RdpAccountant
from fedcore.algorithms.participants import chosen_clients
from fedcore.config import declare, non_negative, positive, validator
from fedcore.errors import ConfigError
from fedcore.schema import clients_per_round

__all__ = ["clip_delta", "gaussian_noise", "noise_generator", "privatize", "central_dp_rule", "install"]

declare("privacy.dp.mode", str, "none", "differential privacy of updates: none, local (clients "
        "clip and add noise before sending) or central (the server clips each update and adds "
        "noise to the aggregate)", choices=("none", "local", "central"))
declare("privacy.dp.clip_norm", float, 1.0, "C: largest L2 norm of an update delta",
        check=positive)
declare("privacy.dp.noise_multiplier", float, 1.0, "sigma: Gaussian noise std is sigma * C",
        check=non_negative)
declare("privacy.dp.clients", list, None, "local: ids of the clients that add noise (default all)")
declare("privacy.dp.fraction", float, None, "local: fraction of clients (seeded draw) that add noise",
        check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")
declare("privacy.dp.delta", float, 1e-5, "delta at which the epsilon spent is reported",
        check=lambda v: None if 0 < v < 1 else "must be in (0, 1)")


@validator
def _check_dp(cfg) -> None:
    mode = cfg["privacy.dp.mode"]
    if mode == "none":
        return
    if cfg["privacy.dp.clients"] is not None and cfg["privacy.dp.fraction"] is not None:
        raise ConfigError("privacy.dp.clients and privacy.dp.fraction are both set; keep one")
    if mode == "central":
        if cfg["privacy.dp.clients"] is not None or cfg["privacy.dp.fraction"] is not None:
            raise ConfigError("privacy.dp.clients/fraction: central DP applies to every update; "
                              "use privacy.dp.mode=local to choose clients")
        if cfg["aggregator.robust_rule"] != "none":
            raise ConfigError("privacy.dp.mode: central DP replaces the aggregation, so it cannot be "
                              "combined with aggregator.robust_rule; set one of them to none")
        if cfg["algorithm.name"] in ("scaffold", "feddyn", "fedasync", "fedbuff"):
            raise ConfigError(f"privacy.dp.mode: central DP cannot wrap algorithm.name "
                              f"{cfg['algorithm.name']} (its aggregation uses more than the mean "
                              "model); use privacy.dp.mode=local")
    if mode == "local" and cfg["algorithm.name"] == "scaffold":
        # dc_i = -c - dy_i/(K eta) would release the clipped-and-noised dy_i exactly
        raise ConfigError("privacy.dp.mode: local DP cannot wrap algorithm.name scaffold (its "
                          "control-variate update reveals the model delta without noise); use "
                          "privacy.dp.mode=none or another algorithm")


# ---------------------------------------------------------------- the mechanism
def clip_delta(vector: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, float]:
    """(vector scaled to L2 norm at most `clip_norm`, its norm before clipping)."""
    norm = vector.norm().item()
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return vector * factor, norm


def gaussian_noise(numel: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """N(0, std^2) noise, float64, drawn from `generator`."""
    return torch.randn(numel, generator=generator, dtype=torch.float64) * std


def noise_generator(seed: int, client_id: int, round_: int) -> torch.Generator:
    """The seeded source of one client's (or, id 0, the server's) noise in one round."""
    return torch.Generator().manual_seed((seed * 1_000_003 + client_id) * 100_003 + round_ + 7)


def privatize(model: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], clip_norm: float,
              noise_multiplier: float, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], float]:
    """`reference + clip(model - reference) + noise` as new tensors; integer entries pass through.
    Returns the new model and the delta's norm before clipping."""
    names = float_names(model)
    delta = {n: model[n].to(torch.float64) - reference[n].to(torch.float64) for n in names}
    vec, norm = clip_delta(flatten(delta, names), clip_norm)
    if noise_multiplier > 0:
        vec = vec + gaussian_noise(vec.numel(), noise_multiplier * clip_norm, generator).to(vec.device)
    noisy = unflatten(vec, delta, names)
    out = dict(model)
    for n in names:
        out[n] = (reference[n].to(torch.float64) + noisy[n]).to(model[n].dtype)
    return out, norm


def central_dp_rule(clip_norm: float, noise_multiplier: float, seed: int):
    """A combination rule: equal-weight mean of clipped deltas plus N(0, (sigma C)^2) / m."""
    def rule(deltas: Deltas, weights: list[float], client_ids: list[int], round_: int):
        names = list(deltas[0])
        clipped, norms = zip(*(clip_delta(flatten(d, names), clip_norm) for d in deltas))
        total = torch.stack(clipped).sum(dim=0)
        if noise_multiplier > 0:
            total = total + gaussian_noise(total.numel(), noise_multiplier * clip_norm,
                                           noise_generator(seed, 0, round_)).to(total.device)
        mean = total / len(deltas)
        return unflatten(mean, deltas[0], names), {
            "dp_clipped": sum(1 for n in norms if n > clip_norm)}
    return rule


# ---------------------------------------------------------------- the behaviour
class _Ledger:
    """Server-side accounting of the epsilon spent (client-level)."""

    def __init__(self, course):
        cfg = course.cfg
        self.mode = cfg["privacy.dp.mode"]
        self.sigma = cfg["privacy.dp.noise_multiplier"]
        self.delta = cfg["privacy.dp.delta"]
        self.q = clients_per_round(cfg) / course.num_clients
        self.central = RdpAccountant()
        self.releases: dict[int, int] = {}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the privacy already spent must survive a resume."""
        return {"rdp": [float(r) for r in self.central._rdp], "steps": self.central.steps,
                "releases": {int(c): n for c, n in self.releases.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.central._rdp = np.array(state["rdp"], dtype=float)
        self.central.steps = int(state["steps"])
        self.releases = {int(c): int(n) for c, n in state["releases"].items()}

    def record(self, client_ids: list[int], noisy: set[int]) -> dict[str, Any]:
        if self.sigma == 0:
            return {"dp_epsilon": None}  # no noise: no finite guarantee
        if self.mode == "central":
            self.central.step(self.q, self.sigma)
            return {"dp_epsilon": self.central.epsilon(self.delta)}
        for c in client_ids:
            if c in noisy:
                self.releases[c] = self.releases.get(c, 0) + 1
        most = max(self.releases.values(), default=0)
        if most == 0:
            return {"dp_epsilon": None}  # no noisy release yet: nothing to account
        acc = RdpAccountant()
        acc.step(1.0, self.sigma, most)
        return {"dp_epsilon": acc.epsilon(self.delta)}


def install(course) -> None:
    """Behaviour: local DP on the chosen clients' trainer output, or central DP on the server."""
    cfg = course.cfg
    clip, sigma, seed = cfg["privacy.dp.clip_norm"], cfg["privacy.dp.noise_multiplier"], cfg["seed"]
    # In a deployment a client process has no server and the server process no trainer:
    # each installs its own half. The noisy clients are drawn over the whole federation.
    server = course.server
    if cfg["privacy.dp.mode"] == "central":
        # Under secure aggregation the clients clip and the noise goes on the unmasked sum
        # (handlers/secure_aggregation.py): the server has no single update to clip.
        if server is not None and not cfg["secure_aggregation.enabled"]:
            replace_combination(server.aggregator, central_dp_rule(clip, sigma, seed),
                                "privacy.dp.mode central")
        noisy: set[int] = set()
    else:
        noisy = chosen_clients(list(range(1, course.num_clients + 1)), cfg["privacy.dp.clients"],
                               cfg["privacy.dp.fraction"], seed, 8101, "privacy.dp")
    if cfg["privacy.dp.mode"] == "local" and course.trainer is not None:
        trainer = course.trainer
        fit = trainer.fit

        def private_fit(client_id, data, received, round_):
            result = fit(client_id, data, received, round_)
            if client_id in noisy:
                gen = noise_generator(seed, client_id, round_)
                if "delta" in result.content:  # updates sent as deltas (FedBuff): noise those
                    delta = result.content["delta"]
                    zero = {n: torch.zeros_like(t) for n, t in delta.items()}
                    delta, norm = privatize(delta, zero, clip, sigma, gen)
                    result.content = dict(result.content, delta=delta)
                else:
                    model, norm = privatize(result.content["model"], received["model"], clip, sigma, gen)
                    result.content = dict(result.content, model=model)
                result.metrics["dp_update_norm"] = norm
            return result
        trainer.fit = private_fit
    if server is None:
        return
    ledger = _Ledger(course)
    course.checkpointer.register("privacy.dp", ledger.state, ledger.restore)
    aggregator = server.aggregator
    aggregate = aggregator.aggregate

    def accounted(updates, round_):
        out = dict(aggregate(updates, round_) or {})
        # an update that stands for several clients (a secure sum) names them in `contributors`
        ids = [c for u in updates for c in getattr(u, "contributors", (u.client_id,))]
        out.update(ledger.record(ids, noisy))
        course.monitor.extra_summary.update(dp_epsilon=out["dp_epsilon"], dp_delta=ledger.delta,
                                            dp_mode=ledger.mode, dp_noisy_clients=len(noisy))
        return out
    aggregator.aggregate = accounted


install.enabled = lambda cfg: cfg["privacy.dp.mode"] != "none"
registry.behaviours.register("differential_privacy", install)
