"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020, Algorithm 1): personal models by Moreau envelopes.

Client i keeps a local model w (starting each round from the global w_t) and a
personal model theta. Each of its R local steps draws one mini-batch D and
  1. solves min_theta f_i(theta; D) + lambda/2 ||theta - w||^2 approximately with
     K gradient steps of the personal learning rate:
     theta <- theta - personal_lr (grad f_i(theta; D) + lambda (theta - w)),
  2. moves the local model toward the result: w <- w - eta lambda (w - theta).
The client sends w; the server sets
  w_{t+1} = (1 - beta) w_t + beta (1/|S|) sum_{i in S} w_i
over the sampled clients S (the paper's plain average). Clients are evaluated
with their personal theta; the global model is the server's (`test_acc`).

R is the round's local work (`train.local_steps` or epochs of batches), eta is
`train.optimizer.lr`, lambda, K, personal_lr and beta are
`algorithm.pfedme.*`. The paper does not say where the inner solver starts;
as in the authors' code theta starts at w_t each round and carries over from
one local step to the next.
"""
from __future__ import annotations

import torch

from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.contract import Algorithm, Trainer
from fedcore.kernel.errors import ConfigError
from fedcore.algorithms.fedrep import UniformAggregator
from fedcore.algorithms.personalization import evaluate_with
from fedcore.kernel.registry import algorithms

__all__ = ["PFedMeTrainer", "PFedMeAggregator", "PFEDME"]

declare("algorithm.pfedme.lambda", float, 15.0,
        "pfedme: lambda, the pull between the personal model theta and the local model w",
        check=positive)
declare("algorithm.pfedme.inner_steps", int, 5,
        "pfedme: K, gradient steps on theta per local step (the inner problem)", check=positive)
declare("algorithm.pfedme.personal_lr", float, 0.01,
        "pfedme: the inner problem's learning rate", check=positive)
declare("algorithm.pfedme.beta", float, 1.0,
        "pfedme: beta, the server's step w <- (1 - beta) w + beta avg(w_i) (1: plain average)",
        check=positive)

PERSONAL = "pfedme_personal"   # the client's theta in its state


@validator
def _check_pfedme(cfg) -> None:
    if cfg["algorithm.name"] != "pfedme":
        return
    o = cfg.section("train.optimizer")
    if o["type"] != "sgd" or o["momentum"] or o["weight_decay"]:
        raise ConfigError("algorithm.name: pfedme takes its own plain gradient steps (eta = "
                          "train.optimizer.lr); set train.optimizer.type=sgd with momentum and "
                          "weight_decay 0")


class PFedMeTrainer(Trainer):
    """R local steps, each K inner steps on theta and one step of w toward theta."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.lam = cfg["algorithm.pfedme.lambda"]
        self.inner_steps = cfg["algorithm.pfedme.inner_steps"]
        self.personal_lr = cfg["algorithm.pfedme.personal_lr"]
        self._theta: list[torch.Tensor] = []

    def begin(self, client_state, received):
        self._theta = [p.detach().clone() for p in self.params]   # theta starts at w_t

    @torch.no_grad()
    def _set(self, values: list[torch.Tensor]) -> None:
        for p, v in zip(self.params, values):
            p.copy_(v)

    def step(self, x, y):
        eta = self.optimizer.param_groups[0]["lr"]   # train.optimizer.lr, as any schedule sets it
        w = [p.detach().clone() for p in self.params]
        self._set(self._theta)
        for _ in range(self.inner_steps):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.objective(x, y)
            loss.backward()
            with torch.no_grad():
                for p, w_i in zip(self.params, w):
                    p.sub_(self.personal_lr * (p.grad + self.lam * (p - w_i)))
        self._theta = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, w_i, theta in zip(self.params, w, self._theta):
                p.copy_(w_i - eta * self.lam * (w_i - theta))
        return loss.item(), float(self.inner_steps * len(y))

    def end(self, client_state, received, steps):
        if steps:
            client_state[PERSONAL] = dict(zip(self.param_names, self._theta))

    def evaluate(self, client_id, data, received):
        """The personal theta (on the received model's other entries) once the client has one."""
        state = self.store.load(client_id)
        if PERSONAL not in state:
            return super().evaluate(client_id, data, received)
        self.load_global(received["model"], state)
        return evaluate_with(self, data, state[PERSONAL])


class PFedMeAggregator(UniformAggregator):
    """w <- (1 - beta) w + beta (1/|S|) sum_i w_i."""

    def aggregate(self, updates, round_):
        before = self.global_state
        metrics = super().aggregate(updates, round_)
        beta = self.cfg["algorithm.pfedme.beta"]
        if beta != 1.0:
            self.global_state = {
                k: torch.lerp(before[k], v, beta) if v is not before[k] and v.is_floating_point() else v
                for k, v in self.global_state.items()}
        return metrics


PFEDME = algorithms.register("pfedme", Algorithm(PFedMeTrainer, PFedMeAggregator, personalized=True))
