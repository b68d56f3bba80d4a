"""MOON (Li, He, Song, CVPR 2021): model-contrastive local training, FedAvg on the server.

Local loss on a batch: CE(logits, y) + mu * l_con with
    l_con = -log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + sum_prev e^{sim(z, z_prev)/tau}) )
averaged over the batch; sim is cosine similarity, z the projection of the
model being trained, z_glob that of the frozen received global model, z_prev
those of this logical client's previous local models (a FIFO of
`buffer_size`, kept in the state store). With no previous model yet the
denominator holds only the positive and l_con is 0, as in the reference.

Work: the trained model's forward+backward costs one gradient evaluation per
sample; each frozen model's forward-only pass is charged `forward_cost`
gradient evaluations per sample (default 1/3: a backward pass costs about
two forwards). With mu = 0 nothing extra is computed or charged.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn

from fedcore.kernel import registry
from fedcore.kernel.contract import Aggregator, Algorithm, Trainer
from fedcore.kernel.config import declare, non_negative, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import algorithms

__all__ = ["MoonTrainer", "MoonAggregator", "MOON", "contrastive_loss"]

declare("algorithm.moon.mu", float, 1.0, "moon: weight of the model-contrastive term (0 gives FedAvg)",
        check=non_negative)
declare("algorithm.moon.temperature", float, 0.5, "moon: temperature tau of the contrastive term",
        check=positive)
declare("algorithm.moon.buffer_size", int, 1, "moon: previous local models kept per client as negatives",
        check=lambda v: None if v >= 1 else "must be >= 1")
declare("algorithm.moon.forward_cost", float, 1 / 3, "moon: gradient evaluations charged per sample "
        "for a forward-only pass of a frozen model", check=non_negative)


@validator
def _check_moon(cfg) -> None:
    if cfg["algorithm.name"] != "moon":
        return
    name = cfg["model.type"]
    if name in registry.models and not getattr(registry.models.get(name), "moon_ready", False):
        ready = [n for n in registry.models.names() if getattr(registry.models.get(n), "moon_ready", False)]
        raise ConfigError(f"model.type: moon needs a model with a projection head; '{name}' has "
                          f"none (use one of: {', '.join(ready)})")


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: list[torch.Tensor],
                     temperature: float) -> torch.Tensor:
    """Batch mean of -log(e^{s_g} / (e^{s_g} + sum e^{s_p})), s = cos(z, .)/tau."""
    sims = [nn.functional.cosine_similarity(z, z_glob, dim=-1)]
    sims += [nn.functional.cosine_similarity(z, zp, dim=-1) for zp in z_prev]
    logits = torch.stack(sims, dim=1) / temperature
    return -(logits[:, 0] - torch.logsumexp(logits, dim=1)).mean()


class MoonTrainer(Trainer):
    """CE + mu * l_con, with the global model and this client's history as frozen references."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        if not hasattr(model, "project_and_classify"):
            raise ConfigError("model.type: moon needs a model with project_and_classify "
                              "(encoder -> projection head -> classifier), e.g. moon_mlp")
        m = cfg.section("algorithm.moon")
        self.mu, self.tau = m["mu"], m["temperature"]
        self.buffer_size, self.forward_cost = m["buffer_size"], m["forward_cost"]
        # scratch modules, reloaded from the received model and the client's own history each round
        self._frozen = [self._scratch() for _ in range(self.buffer_size + 1)]
        self._active: list[nn.Module] = []

    def _scratch(self) -> nn.Module:
        m = copy.deepcopy(self.model)
        for p in m.parameters():
            p.requires_grad_(False)
        return m.eval()

    def begin(self, client_state: dict, received: dict) -> None:
        if self.mu == 0:
            self._active = []
            return
        history = client_state.get("history", [])
        self._frozen[0].load_state_dict(self.model.state_dict())    # the received global model
        for module, past in zip(self._frozen[1:], history):
            module.load_state_dict(past)
        self._active = self._frozen[:1 + len(history)]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        self.optimizer.zero_grad(set_to_none=True)
        work = float(len(y))
        if self.mu == 0:
            loss = self.objective(x, y)
        else:
            z, logits = self.model.project_and_classify(x)
            with torch.no_grad():
                refs = [m.project(x) for m in self._active]
            work += self.forward_cost * len(y) * len(refs)
            loss = (self._data_loss(logits, y)
                    + self.mu * contrastive_loss(z, refs[0], refs[1:], self.tau))
        loss.backward()
        self.adjust_gradients()
        self.optimizer.step()
        return loss.item(), work

    def _data_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.loss == "mse":
            return nn.functional.mse_loss(out.reshape(y.shape), y)
        return nn.functional.cross_entropy(out, y)

    def payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict:
        if self.mu != 0:
            history = list(client_state.get("history", []))
            history.append(OrderedDict((k, v.detach().clone()) for k, v in self.model.state_dict().items()))
            client_state["history"] = history[-self.buffer_size:]    # FIFO
        return super().payload(client_state, received, steps, n_train)


class MoonAggregator(Aggregator):
    """Sample-weighted FedAvg: MOON changes only the local objective."""


MOON = algorithms.register("moon", Algorithm(MoonTrainer, MoonAggregator))
