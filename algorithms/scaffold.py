"""SCAFFOLD (Karimireddy et al., ICML 2020), Algorithm 1 with option II control variates.

Server state: the model x and the control variate c. Client i keeps c_i (zero
until its first round) in the state store. Each local step corrects the
gradient, y_i <- y_i - eta (g_i(y_i) + c - c_i); after K steps
c_i+ = c_i - c + (x - y_i) / (K eta), and the client sends dy_i = y_i - x and
dc_i = c_i+ - c_i. The server applies
    x <- x + eta_g * mean_S(dy_i)        (uniform, or sample-weighted)
    c <- c + (1/N) * sum_S(dc_i)
Broadcast and update each carry two model-sized tensors sets, and the byte
counts show it. Control variates cover shared trainable parameters; buffers
(e.g. batch-norm statistics) travel as plain deltas.
"""
from __future__ import annotations

import logging

import torch

from fedcore.kernel.contract import Aggregator, Algorithm, ReceivedUpdate, Trainer, weighted_mean
from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import algorithms
from fedcore.kernel.vector_term import VectorTerm, stack_state

__all__ = ["ScaffoldTrainer", "ScaffoldTerm", "ScaffoldAggregator", "SCAFFOLD"]

declare("algorithm.scaffold.global_lr", float, 1.0, "scaffold: server learning rate eta_g",
        check=positive)
declare("algorithm.scaffold.weighting", str, "uniform",
        "scaffold: how client deltas dy_i are averaged: uniform (the paper) or num_samples",
        choices=("uniform", "num_samples"))
declare("algorithm.scaffold.allow_async", bool, False,
        "scaffold: allow asynchronous aggregation (the paper's analysis is synchronous)")

log = logging.getLogger("fedcore.algorithms.scaffold")


@validator
def _check_scaffold(cfg) -> None:
    if cfg["algorithm.name"] != "scaffold":
        return
    if cfg.get("asyn.use", False) and not cfg["algorithm.scaffold.allow_async"]:
        raise ConfigError("asyn.use: scaffold is synchronous (stale control variates break its "
                          "correction); set asyn.use=false or algorithm.scaffold.allow_async=true")


def _plain_sgd(cfg) -> bool:
    o = cfg.section("train.optimizer")
    return o["type"] == "sgd" and o["momentum"] == 0 and o["weight_decay"] == 0


class ScaffoldTrainer(Trainer):
    """Local SGD with the drift correction c - c_i; sends (dy_i, dc_i)."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.lr = cfg["train.optimizer.lr"]
        self.shared_changed()
        self._correction: list[torch.Tensor] = []
        if not _plain_sgd(cfg):
            log.warning("scaffold: train.optimizer is not plain SGD (type sgd, momentum 0, "
                        "weight_decay 0); c_i+ = c_i - c + (x - y_i)/(K eta) then no longer "
                        "estimates the client gradient as in the paper")

    def shared_changed(self) -> None:
        self.names = [n for n in self.param_names if self.shared(n)]
        self._corrected = [self.entries[n] for n in self.names]

    def begin(self, client_state: dict, received: dict) -> None:
        c = received["control"]
        c_i = client_state.get("c_i")
        # c - c_i, fixed for the whole round
        self._correction = [c[n].clone() if c_i is None else c[n] - c_i[n] for n in self.names]
        self._lr_sum = 0.0

    @torch.no_grad()
    def adjust_gradients(self) -> None:
        # once per optimizer step: the step sizes actually used (an LR schedule changes them)
        self._lr_sum += self.optimizer.param_groups[0]["lr"]
        for p, corr in zip(self._corrected, self._correction):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(corr)

    @torch.no_grad()
    def payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict:
        x = received["model"]
        c = received["control"]
        c_i = client_state.get("c_i") or {n: torch.zeros_like(c[n]) for n in self.names}
        y = self.shared_state()
        delta_model = {k: y[k] - x[k] for k in y}
        delta_control, new_c_i = {}, {}
        for n in self.names:
            if steps > 0:
                # (x - y)/(K eta) with constant eta; the sum of the step sizes taken in general
                new = c_i[n] - c[n] + (x[n] - y[n]) / self._lr_sum
            else:  # no local data: nothing learnt, keep c_i
                new = c_i[n].clone()
            delta_control[n] = new - c_i[n]
            new_c_i[n] = new
        client_state["c_i"] = new_c_i
        self._correction = []   # c - c_i: a model, not kept while the update is folded and sent
        return {"delta": delta_model, "delta_control": delta_control, "num_samples": n_train}

    def vector_term(self) -> VectorTerm:
        return ScaffoldTerm(self)


class ScaffoldTerm(VectorTerm):
    """SCAFFOLD for a stack of clients: + (c - c_i); sends (y - x, c_i+ - c_i), keeps c_i+."""

    def names(self):
        return list(self.trainer.names)

    def prepare(self, received, states):
        c = received["control"]
        names = self.trainer.names
        c_i = stack_state(states, "c_i", names, c)
        fresh = torch.tensor([st.get("c_i") is None for st in states], device=self.trainer.device)
        corr = {}
        for n in names:
            # c - c_i; a client without c_i uses c itself, as `begin` does
            corr[n] = torch.where(fresh.reshape((-1,) + (1,) * c[n].dim()), c[n], c[n] - c_i[n])
        return corr, c_i

    def adjust(self, ctx, name, grad, param):
        return grad + ctx[0][name]

    def finish(self, ctx, received, params, steps, states, sizes):
        x, c = received["model"], received["control"]
        _, c_i = ctx
        lr = self.trainer.lr
        delta = {n: params[n] - x[n] for n in params}
        dc, new_c = {}, {}
        for n in self.trainer.names:
            if steps > 0:
                new = c_i[n] - c[n] + (x[n] - params[n]) / (steps * lr)
            else:
                new = c_i[n].clone()
            dc[n] = new - c_i[n]
            new_c[n] = new
        rows = {k: {n: t.unbind(0) for n, t in d.items()} for k, d in
                (("delta", delta), ("dc", dc), ("c", new_c))}
        out = []
        for j, (st, size) in enumerate(zip(states, sizes)):
            new_state = dict(st)
            new_state["c_i"] = {n: r[j].clone() for n, r in rows["c"].items()}   # its own storage
            content = {"delta": {n: r[j] for n, r in rows["delta"].items()},
                       "delta_control": {n: r[j] for n, r in rows["dc"].items()},
                       "num_samples": size}
            out.append((content, new_state))
        return out


class ScaffoldAggregator(Aggregator):
    """x <- x + eta_g mean(dy_i); c <- c + (1/N) sum(dc_i).

    Both are linear in the updates, so a round may fold them as they arrive
    (algorithms/streaming.py): the weighted mean of dy_i and the sum of dc_i, which arrive as
    one update whose mean and sum are themselves."""

    streams_updates = True
    folded = {"delta": False, "delta_control": True}

    def __init__(self, model, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        self.global_lr = cfg["algorithm.scaffold.global_lr"]
        self.weighting = cfg["algorithm.scaffold.weighting"]
        names = [n for n, p in model.named_parameters() if p.requires_grad and self.shared(n)]
        self.control: dict[str, torch.Tensor] = {n: torch.zeros_like(self.global_state[n]) for n in names}
        # eta_g scales the parameters' step; buffers (BatchNorm statistics, counters) are no step
        # to scale: they take the plain mean delta (eta_g > 1 could make a variance negative)
        self.parameter_names = {n for n, _ in model.named_parameters()}

    def shared_changed(self) -> None:
        self.control = {n: c for n, c in self.control.items() if self.shared(n)}

    def broadcast(self, round_: int) -> dict:
        content = super().broadcast(round_)
        content["control"] = dict(self.control)
        return content

    def weights(self, updates: list[ReceivedUpdate]) -> list[float]:
        if self.weighting == "uniform":
            return [1.0] * len(updates)
        return super().weights(updates)

    @torch.no_grad()
    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict:
        weights = self.weights(updates)
        if sum(weights) <= 0:
            weights = [1.0] * len(updates)
        new_state = dict(self.global_state)
        for name in updates[0].content["delta"]:
            mean = weighted_mean([u.content["delta"][name] for u in updates], weights)
            x = self.global_state[name]
            if name in self.parameter_names:
                new_state[name] = x + self.global_lr * mean
            else:  # buffers, floating (running statistics) or integer (batch counters)
                new_state[name] = x + mean
        new_control = {}
        for name, c in self.control.items():
            total = torch.stack([u.content["delta_control"][name] for u in updates]).sum(0)
            new_control[name] = c + total / self.num_clients
        self.global_state, self.control = new_state, new_control
        return {}

    def state_dict(self) -> dict:
        return {"control": dict(self.control)}

    def load_state_dict(self, state: dict) -> None:
        self.control = dict(state["control"])


def update_layout(server) -> dict:
    """What a deployed server accepts from a client: dy_i over the model, dc_i over c."""
    agg = server.aggregator
    return {"delta": agg.broadcast(server.round)["model"], "delta_control": agg.control}


SCAFFOLD = algorithms.register("scaffold", Algorithm(ScaffoldTrainer, ScaffoldAggregator,
                                                     update_layout=update_layout))
