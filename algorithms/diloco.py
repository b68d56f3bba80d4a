"""DiLoCo (Douillard et al., 2023): H inner AdamW steps per client, an outer optimizer on the server.

Each round every selected client runs exactly H = `train.local_steps` optimizer steps
of its own inner optimizer from the global model θ and sends its weights θ_k (the
FedAvg payload). The server forms the outer gradient g = −Σ_k p_k (θ_k − θ) / Σ_k p_k
and applies SGD, momentum SGD or Nesterov momentum SGD to θ (PyTorch's recurrences,
no dampening) through the server-optimizer mechanism (`fedcore.runtime.server_optimizer`);
the momentum buffers are server state that persists across rounds.
Inner optimizer and scheduler state stay in each client's state store. The alignment
note docs/algorithms/diloco.md maps the contract to this code and its tests.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fedcore.kernel.contract import Aggregator, Algorithm, ReceivedUpdate, Trainer, weighted_mean
from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import algorithms
from fedcore.kernel.schema import clients_per_round
from fedcore.runtime.server_optimizer import ServerOptimizer, l2_norm

__all__ = ["DiLoCoTrainer", "DiLoCoAggregator", "DILOCO", "reset_warnings"]

log = logging.getLogger("fedcore.diloco")

declare("algorithm.diloco.outer_optimizer", str, "nesterov",
        "diloco: server-side outer optimizer on the outer gradient (sgd, sgdm = momentum SGD, "
        "nesterov = Nesterov momentum SGD; PyTorch conventions, no dampening)",
        choices=("sgd", "sgdm", "nesterov"))
declare("algorithm.diloco.outer_learning_rate", float, 0.7, "diloco: outer learning rate",
        check=positive)
declare("algorithm.diloco.outer_momentum", float, 0.9, "diloco: outer momentum (sgdm, nesterov)",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("algorithm.diloco.aggregation_weighting", str, "uniform",
        "diloco: how client deltas are averaged: uniform, or num_samples (FedAvg's weighting)",
        choices=("uniform", "num_samples"))
declare("algorithm.diloco.apply_outer_optimizer_to", str, "parameters",
        "diloco: entries the outer optimizer acts on: parameters (trainable floating parameters; "
        "other floating entries are averaged without momentum) or all_floating (experimental)",
        choices=("parameters", "all_floating"))

_PAYLOAD_KEYS = frozenset({"model", "num_samples"})
_warned: set[str] = set()


def reset_warnings() -> None:
    """Forget which not-faithful warnings were given (each is logged once per process)."""
    _warned.clear()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


@validator
def _check_diloco(cfg) -> None:
    """Refuse what cannot be faithful DiLoCo; warn once about what is allowed but not faithful."""
    if cfg["algorithm.name"] != "diloco":
        return
    if cfg["train.local_steps"] is None:
        raise ConfigError("train.local_steps: algorithm diloco needs H = train.local_steps "
                          "(completed optimizer steps per round); epoch-based local work is not supported")
    if not cfg["train.preserve_optimizer_state"]:
        raise ConfigError("train.preserve_optimizer_state: algorithm diloco keeps each client's inner "
                          "optimizer and scheduler state across rounds; set it to true")
    if cfg["data.splits"][0] <= 0:
        raise ConfigError("data.splits: algorithm diloco needs a training split (first fraction > 0) "
                          "so every client can take H optimizer steps")
    if cfg.get("asyn.use"):
        raise ConfigError("asyn.use: algorithm diloco is synchronous (each delta must be taken against "
                          "the current global model); set asyn.use=false")
    unfaithful = "diloco: not faithful:"
    if cfg["train.optimizer.type"] != "adamw":
        _warn_once(f"{unfaithful} train.optimizer.type={cfg['train.optimizer.type']} (DiLoCo's inner "
                   "optimizer is adamw)")
    if cfg["algorithm.diloco.apply_outer_optimizer_to"] == "all_floating":
        _warn_once(f"{unfaithful} apply_outer_optimizer_to=all_floating also puts buffers under the "
                   "outer optimizer (experimental; the default is parameters)")
    if clients_per_round(cfg) < cfg["federate.client_num"]:
        _warn_once(f"{unfaithful} partial participation ({clients_per_round(cfg)} of "
                   f"{cfg['federate.client_num']} clients per round); outer momentum mixes different "
                   "client subsets")
    if cfg["federate.share_params"]:
        _warn_once(f"{unfaithful} federate.share_params keeps some entries local; they never see "
                   "the outer optimizer")
    if cfg["course"] != "sync":
        _warn_once(f"{unfaithful} course={cfg['course']} is not the synchronous course; stale "
                   "updates are refused at run time")


class DiLoCoTrainer(Trainer):
    """Inner loop: exactly H completed optimizer steps per round, counted at the optimizer.

    The base trainer already keeps the per-client data stream, optimizer and scheduler
    state in the state store; this class checks that the round took exactly H real
    `optimizer.step()` calls and keeps the client's running total of inner steps.
    """

    def __init__(self, model: nn.Module, cfg, store):
        super().__init__(model, cfg, store)
        self.h = cfg["train.local_steps"]
        self._taken = 0
        self.optimizer.register_step_post_hook(self._count_step)

    def _count_step(self, *_: Any) -> None:
        self._taken += 1

    def begin(self, client_state: dict, received: dict) -> None:
        self._taken = 0

    def end(self, client_state: dict, received: dict, steps: int) -> None:
        if self._taken != self.h:
            raise RuntimeError(f"diloco: the client took {self._taken} optimizer steps this round, "
                               f"not H={self.h} (a client without training samples cannot take H steps)")
        client_state["inner_steps"] = client_state.get("inner_steps", 0) + self._taken


class DiLoCoAggregator(Aggregator):
    """Outer step on the averaged client deltas; momentum buffers are server-owned state."""

    streams_updates = True   # the mean delta is the mean model's delta (algorithms/streaming.py)

    def __init__(self, model: nn.Module, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        o = cfg.section("algorithm.diloco")
        self.kind = o["outer_optimizer"]
        self.lr = o["outer_learning_rate"]
        self.mu = o["outer_momentum"]
        # the outer step x <- x + u(Δ) with Δ = -g: the server-optimizer mechanism's sgd, sgdm
        # or nesterov (PyTorch's recurrences on g, negated exactly)
        self.outer = ServerOptimizer(self.kind, self.lr, momentum=self.mu)
        self.weighting = o["aggregation_weighting"]
        if o["apply_outer_optimizer_to"] == "parameters":
            self.outer_names = {n for n, p in model.named_parameters(remove_duplicate=False)
                                if p.requires_grad and p.is_floating_point()}
        else:
            self.outer_names = {n for n, v in self.global_state.items() if v.is_floating_point()}
        self.rounds = 0

    def weights(self, updates: list[ReceivedUpdate]) -> list[float]:
        if self.weighting == "num_samples":
            w = super().weights(updates)
            if sum(w) > 0:
                return w
        return [1.0] * len(updates)

    @staticmethod
    def _check(updates: list[ReceivedUpdate]) -> None:
        for u in updates:
            if u.staleness:
                raise ValueError(f"diloco: update from client {u.client_id} is stale by {u.staleness} "
                                 "round(s); DiLoCo takes every delta against the current global model")
            extra = set(u.content) - _PAYLOAD_KEYS
            if extra:
                raise ValueError(f"diloco: update from client {u.client_id} carries {sorted(extra)}; "
                                 "DiLoCo clients send only model weights and num_samples (optimizer "
                                 "state stays on the client)")

    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        self._check(updates)
        weights = self.weights(updates)
        new_state = dict(self.global_state)
        deltas: dict[str, torch.Tensor] = {}
        for name in updates[0].content["model"]:
            old = self.global_state[name]
            received = [u.content["model"][name] for u in updates]
            if name not in self.outer_names:
                new_state[name] = weighted_mean(received, weights)     # rounded back if integer
                continue
            deltas[name] = weighted_mean([t.to(old.dtype) - old for t in received], weights)
        steps = self.outer.updates(deltas)
        for name, step in steps.items():
            new_state[name] = self.global_state[name] + step
        self.global_state = new_state
        self.rounds += 1
        grad_norm = l2_norm(deltas.values())
        return {"outer_lr": self.lr, "outer_grad_norm": grad_norm,
                "mean_delta_norm": grad_norm, "outer_update_norm": l2_norm(steps.values()),
                "outer_momentum_norm": l2_norm(self.outer.m.values())}

    def state_dict(self) -> dict[str, Any]:
        # the momentum buffer on the outer gradient g = -Δ (PyTorch's sign)
        return {"outer_momentum": {k: -v for k, v in self.outer.m.items()},
                "outer_rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the outer optimizer's state (from `state_dict`, e.g. a checkpoint)."""
        self.outer.load_state_dict({"m": {k: -v for k, v in state.get("outer_momentum", {}).items()},
                                    "t": int(state.get("outer_rounds", 0))})
        self.rounds = int(state.get("outer_rounds", 0))


DILOCO = algorithms.register("diloco", Algorithm(DiLoCoTrainer, DiLoCoAggregator))
