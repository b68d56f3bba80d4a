"""FedBuff (Nguyen et al., 2022): buffered asynchronous aggregation of model deltas.

Client k trains from the global model it received, w_k^0, and sends the delta
Delta_k = w_k - w_k^0. The server waits for a buffer of K updates (the
course's aggregation goal, `asyn.min_received_num`), then

    w <- w + eta_g * (1/K) * sum_k s(tau_k) Delta_k

with eta_g = `algorithm.fedbuff.server_lr` and s the course's staleness
discount (1 when none is set). With eta_g = 1 and fresh updates this is the
unweighted mean of the clients' models. Non-float entries (counters) are not
deltas: they are averaged like FedAvg.
"""
from __future__ import annotations

from fedcore.kernel.contract import Aggregator, Algorithm, ReceivedUpdate, Trainer, weighted_mean
from fedcore.kernel.config import declare, positive
from fedcore.kernel.registry import algorithms

__all__ = ["FedBuffTrainer", "FedBuffAggregator", "FEDBUFF"]

declare("algorithm.fedbuff.server_lr", float, 1.0, "FedBuff: server learning rate eta_g applied to "
        "the mean buffered delta", check=positive)


class FedBuffTrainer(Trainer):
    """Local training as FedAvg; sends the change of each float entry instead of the weights."""

    def payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict:
        start = received["model"]
        delta, model = {}, {}
        for name, t in self.shared_state().items():
            if t.is_floating_point() and name in start:
                delta[name] = t - start[name]
            else:
                model[name] = t
        return {"delta": delta, "model": model, "num_samples": n_train}


class FedBuffAggregator(Aggregator):
    """w + eta_g * mean_k s(tau_k) Delta_k over the buffered updates."""

    def __init__(self, model, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        self.server_lr = cfg["algorithm.fedbuff.server_lr"]

    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        k = len(updates)
        factors = [self.server_lr * (self.discount(u.staleness) if self.discount else 1.0) / k
                   for u in updates]
        new_state = dict(self.global_state)
        for name in updates[0].content["delta"]:
            acc = self.global_state[name].clone()
            for u, f in zip(updates, factors):
                acc.add_(u.content["delta"][name], alpha=f)
            new_state[name] = acc
        for name in updates[0].content["model"]:
            new_state[name] = weighted_mean([u.content["model"][name] for u in updates], [1.0] * k)
        self.global_state = new_state
        return {"fedbuff_weight_sum": float(sum(factors))}


def update_layout(server) -> dict:
    """What a deployed server accepts: deltas of the floating entries, the others as weights."""
    shared = server.aggregator.broadcast(server.round)["model"]
    return {"delta": {k: v for k, v in shared.items() if v.is_floating_point()},
            "model": {k: v for k, v in shared.items() if not v.is_floating_point()}}


FEDBUFF = algorithms.register("fedbuff", Algorithm(FedBuffTrainer, FedBuffAggregator,
                                                   update_layout=update_layout))
