"""Split learning for vertical courses: bottom models per party, a top model at the active party.

Every party p holds a bottom model f_p over its columns; the active party (0) also holds the
top model g and the labels. For a mini-batch B the course computes
    loss = CE(g([f_0(x_0B), f_1(x_1B), ..., f_{P-1}(x_{P-1}B)]), y_B)
with the cut-layer activations h_p = f_p(x_pB) sent to the active party and dL/dh_p sent back.
Each party steps its own parameters with its own optimizer; SGD and Adam update each
parameter from its own gradient alone, so the course equals training the composed model on
the joined columns with one optimizer (tests/test_vertical_splitnn.py).

Batch order: epoch e's permutation of the aligned training rows is drawn from (seed, e), so
every party, simulated or deployed, cuts the same batches without a message.
`vertical.gradient_noise` adds Gaussian noise to each returned dL/dh_p (the standard mitigation
of label leakage through cut-layer gradients; docs/vertical.md): seeded in simulation, from the
operating system in a deployment.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from fedcore.kernel.config import declare, non_negative, positive
from fedcore.kernel.registry import components
from fedcore.algorithms.dp_noise import OS_NOISE, deployed, standard_normal

__all__ = ["batches_per_epoch", "batch_rows", "bottom_model", "top_model", "make_optimizer",
           "BottomParty", "TopParty"]

declare("vertical.method", str, "splitnn", "vertical: splitnn (bottom models, top model at the "
        "active party) or he_lr (logistic regression on Paillier-encrypted residuals)",
        choices=("splitnn", "he_lr"))
declare("vertical.cut", int, 16, "splitnn: width of each party's cut-layer activation", check=positive)
declare("vertical.bottom_hidden", list, [], "splitnn: hidden widths of each bottom model (empty: "
        "one linear layer and a ReLU)")
declare("vertical.top_hidden", list, [], "splitnn: hidden widths of the top model (empty: linear)")
declare("vertical.gradient_noise", float, 0.0, "splitnn: standard deviation of Gaussian noise the "
        "active party adds to each cut-layer gradient it returns (label-leakage mitigation; 0: exact)",
        check=non_negative)


def batches_per_epoch(n: int, batch_size: int) -> int:
    return max(1, math.ceil(n / batch_size))


def batch_rows(seed: int, n: int, batch_size: int, step: int) -> torch.Tensor:
    """The aligned training rows of global step `step` (0-based): epoch step // k's seeded order."""
    k = batches_per_epoch(n, batch_size)
    epoch, b = divmod(step, k)
    order = np.random.default_rng([seed, 41, epoch]).permutation(n)
    return torch.from_numpy(order[b * batch_size:(b + 1) * batch_size].copy())


def _mlp(sizes: list[int], relu_last: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]   # image strips (N, C, H, w) or columns (N, d)
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or relu_last:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _seeded(seed: int, tag: int, build, dtype: torch.dtype) -> nn.Module:
    """A model initialised from (seed, tag) alone: every process builds the same one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1009 + tag)
        return build().to(dtype)


def bottom_model(cfg, party: int, in_shape: tuple[int, ...] | int) -> nn.Module:
    """Party `party`'s bottom model over samples of `in_shape` (its columns, or its image strip)."""
    in_features = in_shape if isinstance(in_shape, int) else math.prod(in_shape)
    sizes = [in_features, *cfg["vertical.bottom_hidden"], cfg["vertical.cut"]]
    return _seeded(cfg["seed"], 100 + party, lambda: _mlp(sizes, relu_last=True),
                   getattr(torch, cfg["model.dtype"]))


def top_model(cfg, parties: int, num_classes: int) -> nn.Module:
    sizes = [parties * cfg["vertical.cut"], *cfg["vertical.top_hidden"], num_classes]
    return _seeded(cfg["seed"], 99, lambda: _mlp(sizes, relu_last=False), getattr(torch, cfg["model.dtype"]))


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    o = cfg.section("train.optimizer")
    if o["type"] == "sgd":
        return torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"] or 0.0,
                               weight_decay=o["weight_decay"] or 0.0)
    cls = torch.optim.Adam if o["type"] == "adam" else torch.optim.AdamW
    return cls(params, lr=o["lr"], weight_decay=o["weight_decay"] or 0.0)


class BottomParty:
    """A party's bottom model over its aligned columns: activations out, gradients in, a step."""

    def __init__(self, cfg, party: int, x_train: torch.Tensor, x_test: torch.Tensor):
        self.cfg, self.party = cfg, party
        self.x_train, self.x_test = x_train, x_test
        self.model = bottom_model(cfg, party, tuple(x_train.shape[1:]))
        self.opt = make_optimizer(cfg, self.model.parameters())
        self._out: torch.Tensor | None = None

    def forward(self, step: int) -> torch.Tensor:
        rows = batch_rows(self.cfg["seed"], len(self.x_train), self.cfg["train.batch_size"], step)
        self._out = self.model(self.x_train[rows])
        return self._out.detach()

    def backward(self, grad: torch.Tensor) -> None:
        if self._out is None or grad.shape != self._out.shape:
            raise ValueError(f"party {self.party}: a cut gradient of shape {tuple(grad.shape)} for "
                             f"activations of shape {tuple(self._out.shape) if self._out is not None else None}")
        self.opt.zero_grad()
        self._out.backward(grad.to(self._out.dtype))
        self.opt.step()
        self._out = None

    def test_activations(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model(self.x_test)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a snapshot keeps of this party (handlers/vertical_snapshot.py): its parameters,
        live, and its optimizer's state (`optimizers`)."""
        return self.model.state_dict()

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"bottom": self.opt}


class TopParty:
    """The active party: its own bottom model, the top model and the labels."""

    def __init__(self, cfg, parties: int, bottom: BottomParty, y_train: torch.Tensor,
                 y_test: torch.Tensor, num_classes: int):
        self.cfg, self.parties, self.bottom = cfg, parties, bottom
        self.y_train, self.y_test = y_train, y_test
        self.top = top_model(cfg, parties, num_classes)
        self.opt = make_optimizer(cfg, self.top.parameters())
        self.noise = torch.Generator().manual_seed(cfg["seed"] * 7919 + 5)

    def step(self, step: int, received: dict[int, torch.Tensor]) -> tuple[dict[int, torch.Tensor], float]:
        """Top forward and backward on a batch: the gradients for each passive party, the loss."""
        rows = batch_rows(self.cfg["seed"], len(self.y_train), self.cfg["train.batch_size"], step)
        own = self.bottom.model(self.bottom.x_train[rows])
        cut = [own] + [received[p].detach().requires_grad_(True) for p in range(1, self.parties)]
        loss = nn.functional.cross_entropy(self.top(torch.cat(cut, dim=1)), self.y_train[rows])
        self.opt.zero_grad()
        self.bottom.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.bottom.opt.step()
        sigma = self.cfg["vertical.gradient_noise"]
        grads = {}
        for p in range(1, self.parties):
            g = cut[p].grad
            if sigma > 0:
                g = g + sigma * self._standard_normal(g)
            grads[p] = g
        return grads, loss.item()

    def _standard_normal(self, g: torch.Tensor) -> torch.Tensor:
        """N(0, 1) noise shaped like `g`: seeded in simulation (reproducible), from the operating
        system in a deployment (a seed in the config would let anyone regenerate and remove it)."""
        if deployed(self.cfg):
            return standard_normal(g.numel(), OS_NOISE).to(g.dtype).reshape(g.shape)
        return torch.randn(g.shape, generator=self.noise, dtype=g.dtype)

    def evaluate(self, received: dict[int, torch.Tensor]) -> dict[str, float]:
        with torch.no_grad():
            cut = [self.bottom.test_activations()] + [received[p] for p in range(1, self.parties)]
            logits = self.top(torch.cat(cut, dim=1))
            if not len(self.y_test):
                return {}
            loss = nn.functional.cross_entropy(logits, self.y_test)
            acc = (logits.argmax(1) == self.y_test).double().mean()
        return {"test_acc": float(acc), "test_loss": float(loss)}

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a snapshot keeps (handlers/vertical_snapshot.py): both models' parameters, live,
        their optimizers' states, and the simulation's gradient-noise generator."""
        return self.state()

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"top": self.opt, "bottom0": self.bottom.opt}

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"top.{k}": v for k, v in self.top.state_dict().items()}
        out.update({f"bottom0.{k}": v for k, v in self.bottom.model.state_dict().items()})
        return out


components.register("splitnn_bottom", BottomParty)
components.register("splitnn_top", TopParty)


def _psi():
    """The PSI module, imported on use (it needs the `cryptography` package)."""
    try:
        from fedcore.algorithms import psi
    except ImportError:
        from fedcore.kernel.errors import ConfigError
        raise ConfigError("data.partition: vertical needs the 'vertical' extra for PSI "
                          "(pip install 'fedcore[vertical]')") from None
    return psi



components.register("psi", _psi)
components.register("batches_per_epoch", batches_per_epoch)
components.register("batch_rows", batch_rows)
