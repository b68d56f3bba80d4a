"""FedMoS (Wang et al., INFOCOM 2023): client double momentum and a pull to the global model.

Each local step t on mini-batch xi_t:
    d_t     = grad f(w_t; xi_t) + (1 - a) (d_{t-1} - grad f(w_{t-1}; xi_t))   (d_0 = grad f(w_0; xi_0))
    w_{t+1} = w_t - eta d_t - mu (w_t - w_g)
with w_g the received global model. grad f(w_{t-1}; xi_t) is the previous
iterate's gradient on the *current* batch, so a step after the first costs
two gradient evaluations (charged as such); with a = 1 the correction is
zero and is not computed. d_{t-1} and w_{t-1} live in the client's state
during its round and are dropped at its end (the paper restarts them each
round). The server is FedAvg, with optional heavy-ball momentum beta on the
averaged delta: m <- beta m + (avg - w), w <- w + m.
"""
from __future__ import annotations

import torch
from torch.func import functional_call

from fedcore.kernel.contract import Aggregator, Algorithm, ReceivedUpdate, Trainer
from fedcore.kernel.config import declare, fraction, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import algorithms

__all__ = ["FedMoSTrainer", "FedMoSAggregator", "FEDMOS"]

declare("algorithm.fedmos.a", float, 0.1, "fedmos: momentum parameter a in (0, 1]; a = 1 is plain SGD",
        check=fraction)
declare("algorithm.fedmos.mu", float, 0.001, "fedmos: coefficient of the pull mu (w - w_g) to the "
        "global model", check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("algorithm.fedmos.server_momentum", float, 0.0, "fedmos: heavy-ball momentum beta on the "
        "server's averaged delta (0: FedAvg)", check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")


@validator
def _check_fedmos(cfg) -> None:
    if cfg["algorithm.name"] != "fedmos":
        return
    o = cfg.section("train.optimizer")
    if o["type"] != "sgd" or o["momentum"] != 0 or o["weight_decay"] != 0:
        raise ConfigError("train.optimizer: fedmos defines its own local update; use type sgd "
                          "with momentum 0 and weight_decay 0 (train.optimizer.lr is eta)")


class FedMoSTrainer(Trainer):
    """The FedMoS local update; the configured optimizer is not used (lr only)."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.a = cfg["algorithm.fedmos.a"]
        self.mu = cfg["algorithm.fedmos.mu"]
        self.lr = cfg["train.optimizer.lr"]
        self._state: dict = {}
        self._anchor: list[torch.Tensor | None] = []

    def begin(self, client_state: dict, received: dict) -> None:
        self._state = client_state
        client_state["fedmos"] = {"d": None, "w_prev": None}
        # w_g for shared parameters; a local-only parameter has no global anchor
        self._anchor = [received["model"].get(n) if self.shared(n) else None for n in self.param_names]

    def _gradients(self, loss: torch.Tensor, params) -> list[torch.Tensor]:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        buf = self._state["fedmos"]
        # both gradients of a step see the same sample xi_t: the pass at w_{t-1} replays the
        # random draws (dropout masks) of the pass at w_t from the same generator state
        draws = torch.get_rng_state() if buf["d"] is not None and self.a != 1 else None
        loss = self.objective(x, y)
        grads = self._gradients(loss, self.params)
        work = float(len(y))
        if buf["d"] is None:
            d = grads
        elif self.a == 1:
            d = grads
        else:
            prev = dict(zip(self.param_names, (w.requires_grad_(True) for w in buf["w_prev"])))
            # the previous iterate's pass updates copies of the module's buffers: a BatchNorm's
            # running statistics follow the iterates w_t alone, as with any other trainer
            buffers = {n: b.clone() for n, b in self.model.named_buffers()}
            after = torch.get_rng_state()
            torch.set_rng_state(draws)
            prev_loss = self._loss(functional_call(self.model, {**prev, **buffers}, (x,)), y)
            torch.set_rng_state(after)
            prev_grads = self._gradients(prev_loss, list(prev.values()))
            work += float(len(y))
            d = [g + (1 - self.a) * (d_old - g_old)
                 for g, d_old, g_old in zip(grads, buf["d"], prev_grads)]
        lr = self.optimizer.param_groups[0]["lr"]   # eta of this step (an LR schedule moves it)
        with torch.no_grad():
            buf["w_prev"] = [p.detach().clone() for p in self.params] if self.a != 1 else None
            for p, d_p, w_g in zip(self.params, d, self._anchor):
                pull = p - w_g if (self.mu != 0 and w_g is not None) else None
                p.add_(d_p, alpha=-lr)
                if pull is not None:
                    p.add_(pull, alpha=-self.mu)
        buf["d"] = [t.detach() for t in d]
        return loss.item(), work

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.loss == "mse":
            return torch.nn.functional.mse_loss(out.reshape(y.shape), y)
        return torch.nn.functional.cross_entropy(out, y)

    def payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict:
        client_state.pop("fedmos", None)   # the momentum restarts each round
        self._state = {}
        return super().payload(client_state, received, steps, n_train)


class FedMoSAggregator(Aggregator):
    """Sample-weighted average; with beta > 0, heavy-ball momentum on the averaged delta."""

    streams_updates = True   # it needs only the weighted mean (algorithms/streaming.py)

    def __init__(self, model, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        self.beta = cfg["algorithm.fedmos.server_momentum"]
        self.momentum: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict:
        if self.beta == 0:
            return super().aggregate(updates, round_)
        previous = self.global_state
        super().aggregate(updates, round_)          # global_state <- weighted average (new tensors)
        averaged, new_state, new_m = self.global_state, dict(previous), {}
        for name, avg in averaged.items():
            if not avg.is_floating_point() or name not in updates[0].content["model"]:
                new_state[name] = avg
                continue
            m = avg - previous[name]
            if name in self.momentum:
                m = m + self.beta * self.momentum[name]
            new_m[name] = m
            new_state[name] = previous[name] + m
        self.global_state, self.momentum = new_state, new_m
        return {}

    def state_dict(self) -> dict:
        return {"momentum": dict(self.momentum)}

    def load_state_dict(self, state: dict) -> None:
        self.momentum = dict(state["momentum"])


FEDMOS = algorithms.register("fedmos", Algorithm(FedMoSTrainer, FedMoSAggregator))
