"""FedAsync (Xie et al., 2019): mix each arriving model into the global one.

For every update (client model x_k computed from a model tau_k rounds old):

    alpha_k = alpha * s(tau_k)
    w <- (1 - alpha_k) * w + alpha_k * x_k

with alpha = `algorithm.fedasync.alpha` and s the course's staleness discount
(1 when none is set). The worker's local problem is the paper's regularised one,
g(x) = f(x) + (rho/2) ||x - x_tau||^2 with x_tau the model it received (FedProx's
proximal step, `algorithm.fedasync.rho`; 0, the default, is plain local SGD).

Meant for a course that aggregates every update as it arrives
(`asyn.min_received_num: 1`); when several arrive together they are mixed in one
after the other, in client-id order. Non-float entries are taken from the last
update mixed in.
"""
from __future__ import annotations

from fedcore.algorithms.fedprox import FedProxTrainer
from fedcore.kernel.contract import Aggregator, Algorithm, ReceivedUpdate
from fedcore.kernel.config import declare, fraction, non_negative
from fedcore.kernel.registry import algorithms

__all__ = ["FedAsyncTrainer", "FedAsyncAggregator", "FEDASYNC"]

declare("algorithm.fedasync.alpha", float, 0.6, "FedAsync: mixing weight alpha of a fresh update",
        check=fraction)
declare("algorithm.fedasync.rho", float, 0.0, "FedAsync: rho of the worker's regularised objective "
        "f(x) + (rho/2)||x - x_tau||^2, x_tau the model it received (0: plain local SGD)",
        check=non_negative)


class FedAsyncTrainer(FedProxTrainer):
    """The worker's local problem of Algorithm 1: FedProx's proximal step with mu = rho, and
    every client taking its full local steps (no stragglers)."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.mu = cfg["algorithm.fedasync.rho"]
        self.fraction = 0.0


class FedAsyncAggregator(Aggregator):
    """w <- (1 - alpha s(tau)) w + alpha s(tau) x, update by update."""

    def __init__(self, model, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        self.alpha = cfg["algorithm.fedasync.alpha"]

    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        state = dict(self.global_state)
        alphas = []
        for u in updates:
            a = self.alpha * (self.discount(u.staleness) if self.discount else 1.0)
            alphas.append(a)
            for name, x in u.content["model"].items():
                w = state[name]
                if w.is_floating_point():
                    state[name] = w * (1.0 - a) + x.to(w.dtype) * a   # new tensors, never in place
                else:
                    state[name] = x.clone()
        self.global_state = state
        return {"fedasync_alpha_mean": sum(alphas) / len(alphas)}


FEDASYNC = algorithms.register("fedasync", Algorithm(FedAsyncTrainer, FedAsyncAggregator))
