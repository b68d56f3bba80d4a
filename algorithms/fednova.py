"""FedNova (Wang et al., NeurIPS 2020): normalized averaging for unequal local work.

Client i runs τ_i local steps of SGD with momentum ρ (step size η, buffer started
at zero each round) from x, so x - x_i = η G_i a_i with G_i its stacked gradients
and a_i the vector the paper derives: a_i,j = (1 - ρ^(τ_i - j)) / (1 - ρ); its
norm ||a_i||_1 = [τ_i - ρ (1 - ρ^τ_i) / (1 - ρ)] / (1 - ρ), which is τ_i for plain
SGD. The client sends that norm with its model. The server averages the
normalized updates d_i = (x - x_i) / ||a_i||_1 with p_i = n_i / Σ n and steps by
τ_eff = Σ_i p_i ||a_i||_1:

    x <- x - τ_eff Σ_i p_i d_i = (1 - s) x + s Σ_i c_i x_i / Σ_i c_i,
    c_i = p_i τ_eff / ||a_i||_1,   s = Σ_i c_i.

With equal τ_i and ρ = 0 every c_i is p_i and s = 1: FedAvg exactly. A server
optimizer (`server_optimizer.*`) then steps from this aggregate, as the paper's
FedNova with server momentum does. Local work varies with `quantity` partitions
(epochs x batches), `algorithm.fednova.straggler_fraction` (FedProx's
stragglers) and any trainer that stops early. Alignment note:
docs/algorithms/fednova.md.
"""
from __future__ import annotations

import logging

import torch

from fedcore.algorithms.fedprox import Straggling
from fedcore.algorithms.robust import INCOMPATIBLE
from fedcore.comm.validation import model_layout
from fedcore.kernel.config import declare, validator
from fedcore.kernel.contract import Aggregator, Algorithm, ReceivedUpdate, Trainer, weighted_mean
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import algorithms

__all__ = ["FedNovaTrainer", "FedNovaAggregator", "FEDNOVA", "norm_factor"]

log = logging.getLogger("fedcore.fednova")

declare("algorithm.fednova.straggler_fraction", float, 0.0,
        "fednova: probability that a sampled client is a straggler doing a random number of "
        "local epochs in [1, E] (steps in [1, K] with train.local_steps), as FedProx's",
        check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")


@validator
def _check_fednova(cfg) -> None:
    """FedNova's a_i is derived for SGD (with momentum) at one step size, buffer fresh each round."""
    if cfg["algorithm.name"] != "fednova":
        return
    if cfg["train.optimizer.type"] != "sgd":
        raise ConfigError(f"train.optimizer.type: fednova's normalizing factor is derived for sgd "
                          f"(with momentum), not {cfg['train.optimizer.type']}; use sgd")
    if cfg["train.preserve_optimizer_state"]:
        raise ConfigError("train.preserve_optimizer_state: fednova's normalizing factor assumes a "
                          "momentum buffer started at zero each round; set it to false")
    if cfg["train.scheduler.type"] != "none":
        raise ConfigError("train.scheduler.type: fednova's normalizing factor assumes one step size "
                          "per round; use train.scheduler.type=none")


def norm_factor(steps: int, momentum: float) -> float:
    """||a||_1 for `steps` steps of SGD with heavy-ball `momentum` ρ: τ for ρ = 0, else
    [τ - ρ (1 - ρ^τ) / (1 - ρ)] / (1 - ρ)."""
    if momentum == 0:
        return float(steps)
    rho = momentum
    return (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho)


class FedNovaTrainer(Straggling, Trainer):
    """Local SGD as FedAvg (stragglers as FedProx draws them); sends ||a_i||_1 of the steps it
    took with the model."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.fraction = cfg["algorithm.fednova.straggler_fraction"]

    def payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict:
        a = norm_factor(steps, self.cfg["train.optimizer.momentum"])
        content = super().payload(client_state, received, steps, n_train)
        content["nova"] = {"a": torch.tensor(a, dtype=torch.float64)}
        return content


class FedNovaAggregator(Aggregator):
    """x - τ_eff Σ p_i (x - x_i) / ||a_i||_1 on floating entries; integer entries p-weighted.

    With c_i = p_i τ_eff / a_i, the mean Σ c_i x_i / Σ c_i is the (p_i / a_i)-weighted mean
    (τ_eff cancels), τ_eff the p-weighted mean of a_i and s = τ_eff Σ(p_i / a_i) / Σ p_i: a
    round may fold its updates as they arrive (algorithms/streaming.py `fold_parts`), equal
    to the list's course to float32 rounding."""

    streams_updates = True
    folded = {"nova": False, "model": False, "model_int": False}   # the first: the round's weight
    fold_reads = ("model", "nova")

    def fold_parts(self, update: ReceivedUpdate, p: float) -> dict:
        """What a folding round sums of `update` (weight p): its floating entries weighted
        p / a_i (nothing where a_i = 0), its integer entries and a_i weighted p."""
        a = self._factor(update)
        model = update.content["model"]
        floating = {n: t for n, t in model.items() if t.is_floating_point()}
        return {"model": (floating, p / a if a > 0 else 0.0),
                "model_int": ({n: t for n, t in model.items() if n not in floating}, p),
                "nova": ({"a": torch.tensor(a, dtype=torch.float64)}, p)}

    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        if len(updates) == 1 and updates[0].owned and "folded_weights" in updates[0].content:
            return self._folded(updates[0].content)
        p = self.weights(updates)
        if sum(p) <= 0:
            p = [1.0] * len(updates)
        a = [self._factor(u) for u in updates]
        total = float(sum(p))
        tau_eff = sum(pi * ai for pi, ai in zip(p, a)) / total
        c = [pi * (tau_eff / ai) if ai > 0 else 0.0 for pi, ai in zip(p, a)]
        s = sum(c) / total
        x = self.global_state
        new_state = dict(x)
        for name in updates[0].content["model"]:
            models = [u.content["model"][name] for u in updates]
            if not x[name].is_floating_point():
                new_state[name] = weighted_mean(models, p)
            elif s > 0:
                mean = weighted_mean(models, c)
                new_state[name] = mean if s == 1 else x[name] + s * (mean - x[name])
            # s == 0: no client did any local work, x stays
        self.global_state = new_state
        return {"fednova_tau_eff": tau_eff}

    def _folded(self, content: dict) -> dict[str, float]:
        """A folding round's sums (`fold_parts`): every p_i = 0 means no client had data, so
        no local work (a_i = 0) and τ_eff = 0, as in the list's course."""
        tau_eff = float(content["nova"]["a"])
        weights = content["folded_weights"]
        s = tau_eff * weights["model"] / weights["nova"] if weights["nova"] > 0 else 0.0
        x, new_state = self.global_state, dict(self.global_state)
        new_state.update(content["model_int"])
        for name, mean in content["model"].items():
            if s > 0:
                new_state[name] = mean if s == 1 else x[name] + s * (mean - x[name])
        self.global_state = new_state
        return {"fednova_tau_eff": tau_eff}

    @staticmethod
    def _factor(update: ReceivedUpdate) -> float:
        a = float(update.content["nova"]["a"])
        if not a >= 0:   # negative (non-finite never passes admission): no usable local work
            log.warning("fednova: client %d sent normalizing factor %r; its update counts as no "
                        "local work", update.client_id, a)
            return 0.0
        return a


def update_layout(server) -> dict:
    """The model's shared entries, and the normalizing factor as a float64 scalar."""
    return {**model_layout(server), "nova": {"a": torch.zeros((), dtype=torch.float64)}}


FEDNOVA = algorithms.register("fednova", Algorithm(FedNovaTrainer, FedNovaAggregator,
                                                   update_layout=update_layout))
INCOMPATIBLE["fednova"] = "its updates are normalized by each client's local work, not models to vote on"
