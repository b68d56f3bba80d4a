"""FedProx (Li et al., MLSys 2020): a proximal term keeps local models near the global one.

Client k minimises h_k(w) = F_k(w) + (mu/2) ||w - w^t||^2 with w^t the model it
received, so each step uses the gradient grad F_k(w) + mu (w - w^t). The term
is added to the gradient directly (`adjust_gradients`), which is exactly the
gradient of the squared norm and is well defined at w = w^t. The server is
FedAvg (sample-weighted).

Systems heterogeneity as in the paper's experiments: a `straggler_fraction`
of clients do a random number of local epochs drawn uniformly from [1, E]
(or, with `train.local_steps` K, a random number of steps in [1, K]) and are
still aggregated. Who straggles is drawn per (seed, round, client).
"""
from __future__ import annotations

import math

import torch

from fedcore.kernel.contract import Aggregator, Algorithm, FitResult, Trainer
from fedcore.kernel.config import declare, non_negative
from fedcore.kernel.registry import algorithms
from fedcore.kernel.vector_term import VectorTerm

__all__ = ["FedProxTrainer", "FedProxTerm", "FedProxAggregator", "FEDPROX", "straggler_steps"]

declare("algorithm.fedprox.mu", float, 0.01, "fedprox: proximal coefficient mu (0 gives FedAvg)",
        check=non_negative)
declare("algorithm.fedprox.straggler_fraction", float, 0.0,
        "fedprox: probability that a sampled client is a straggler doing a random number of local "
        "epochs in [1, E] (steps in [1, K] with train.local_steps)",
        check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")


def straggler_steps(seed: int, round_: int, client_id: int, fraction: float, epochs: int | None,
                    steps_per_epoch: int, full_steps: int, accum: int = 1) -> int:
    """Local steps for this (round, client): `full_steps`, or fewer if it straggles this round.
    With `epochs`, a straggler trains e in [1, E] of them: e * steps_per_epoch batches, which
    are ceil(e * steps_per_epoch / accum) optimizer steps when each step accumulates `accum`
    batches (`train.grad_accum_steps`), as `full_steps` counts E epochs."""
    if fraction <= 0:
        return full_steps
    g = torch.Generator().manual_seed(((seed * 7_919 + round_) * 1_000_003 + client_id) % (2**63))
    if torch.rand((), generator=g, dtype=torch.float64).item() >= fraction:
        return full_steps
    if epochs is not None:  # epochs in [1, E]
        return math.ceil(int(torch.randint(1, epochs + 1, (), generator=g)) * steps_per_epoch / accum)
    return int(torch.randint(1, full_steps + 1, (), generator=g))


class Straggling:
    """Mixed into a trainer before `Trainer`: a `fraction` of the clients straggle each round
    and take fewer local steps, drawn from (seed, round, client) by `straggler_steps`."""

    fraction = 0.0
    _round = 0
    _client = 0

    def fit(self, client_id: int, data, received: dict, round_: int) -> FitResult:
        self._round, self._client = round_, client_id
        return super().fit(client_id, data, received, round_)

    def num_steps(self, n_train: int) -> int:
        full = super().num_steps(n_train)
        per_epoch = math.ceil(n_train / self.cfg["train.batch_size"])
        epochs = None if self.cfg["train.local_steps"] is not None else self.cfg["train.local_epochs"]
        return straggler_steps(self.cfg["seed"], self._round, self._client, self.fraction, epochs,
                               per_epoch, full, self.grad_accum)


class FedProxTrainer(Straggling, Trainer):
    """Local training on F_k(w) + (mu/2)||w - w^t||^2 (shared trainable parameters)."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.mu = cfg["algorithm.fedprox.mu"]
        self.fraction = cfg["algorithm.fedprox.straggler_fraction"]
        self.shared_changed()
        self._anchor: list[torch.Tensor] = []

    def shared_changed(self) -> None:
        self._prox = [(p, n) for p, n in zip(self.params, self.param_names) if self.shared(n)]

    def begin(self, client_state: dict, received: dict) -> None:
        # w^t: the received global model (read only; those tensors are never mutated)
        self._anchor = [received["model"][n] for _, n in self._prox]

    @torch.no_grad()
    def adjust_gradients(self) -> None:
        if self.mu == 0:
            return
        for (p, _), w_t in zip(self._prox, self._anchor):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(p - w_t, alpha=self.mu)

    def vector_term(self) -> VectorTerm:
        return FedProxTerm(self)


class FedProxTerm(VectorTerm):
    """FedProx for a stack of clients: + mu (w - w^t); stragglers' step counts drawn as `fit` does."""

    def num_steps(self, client_id, n, round_):
        self.trainer._round, self.trainer._client = round_, client_id   # what `fit` sets
        return self.trainer.num_steps(n)

    def prepare(self, received, states):
        return self.trainer.mu, received["model"]

    def adjust(self, ctx, name, grad, param):
        mu, anchor = ctx
        if mu == 0:
            return grad
        return grad.add(param - anchor[name], alpha=mu)


class FedProxAggregator(Aggregator):
    """Sample-weighted average, as FedAvg (stragglers' partial work is aggregated too)."""


FEDPROX = algorithms.register("fedprox", Algorithm(FedProxTrainer, FedProxAggregator))
