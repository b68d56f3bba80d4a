"""Model builders. Each takes `(cfg, input_shape, num_classes)`; shapes come from the data."""
from __future__ import annotations

import math

import torch
from torch import nn

from fedcore.registry import models

__all__ = ["build_model", "logreg", "mlp"]


def build_model(cfg, input_shape, num_classes: int) -> nn.Module:
    """Build `model.type` in `model.dtype`, seeded by the run's seed."""
    torch.manual_seed(cfg["seed"])
    model = models.get(cfg["model.type"])(cfg, tuple(input_shape), num_classes)
    return model.to(getattr(torch, cfg["model.dtype"]))


@models.register("logreg")
def logreg(cfg, input_shape, num_classes: int) -> nn.Module:
    """Multinomial logistic regression (a linear layer on the flattened input)."""
    out = 1 if cfg["train.loss"] == "mse" else num_classes
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), out))


@models.register("mlp")
def mlp(cfg, input_shape, num_classes: int) -> nn.Module:
    """Fully connected ReLU network with `model.hidden` widths."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in cfg["model.hidden"]:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        width = int(h)
    layers.append(nn.Linear(width, 1 if cfg["train.loss"] == "mse" else num_classes))
    return nn.Sequential(*layers)
