"""Bring your own dataset, partitioner, model and trainer: one registration each.

Put this module on PYTHONPATH and name it under `plugins:`; the config then
selects each piece by name (docs/extending.md walks through it):

    plugins: [my_plugins]
    data: {type: rings, partition: by_quadrant}
    model: {type: tiny_mlp}
    algorithm: {name: smooth_fedavg}
"""
import math

import numpy as np
import torch
from torch import nn

from fedcore.kernel.config import declare, positive
from fedcore.kernel.contract import Aggregator, Algorithm, Trainer
from fedcore.kernel.registry import algorithms, datasets, models, partitioners
from fedcore.scenarios.data import RawDataset

declare("data.rings.samples", int, 600, "rings: number of samples", check=positive)
declare("model.tiny_mlp.width", int, 16, "tiny_mlp: hidden width", check=positive)
declare("algorithm.smooth_fedavg.eps", float, 0.1, "smooth_fedavg: label smoothing",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")


@datasets.register("rings")
def rings(cfg) -> RawDataset:
    """Points in [-2, 2]^2, labelled 1 outside the circle of radius 1.2; seeded by `seed`."""
    g = torch.Generator().manual_seed(cfg["seed"])
    x = torch.rand(cfg["data.rings.samples"], 2, generator=g) * 4 - 2
    y = (x.norm(dim=1) > 1.2).long()
    return RawDataset(x, y, num_classes=2)


@partitioners.register("by_quadrant")
def by_quadrant(raw: RawDataset, n: int, cfg) -> list[np.ndarray]:
    """Client k holds samples of quadrant k mod 4 only, split evenly among that quadrant's clients."""
    quadrant = ((raw.x[:, 0] > 0).long() * 2 + (raw.x[:, 1] > 0).long()).numpy()
    parts: list[np.ndarray] = []
    for k in range(n):
        members = [c for c in range(n) if c % 4 == k % 4]     # the clients sharing quadrant k % 4
        idx = np.flatnonzero(quadrant == k % 4)
        parts.append(np.array_split(idx, len(members))[members.index(k)])
    return parts


@models.register("tiny_mlp")
def tiny_mlp(cfg, input_shape, num_classes: int) -> nn.Module:
    """One hidden tanh layer; shapes come from the data."""
    width = cfg["model.tiny_mlp.width"]
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.Tanh(),
                         nn.Linear(width, num_classes))


class SmoothTrainer(Trainer):
    """FedAvg's local SGD on a label-smoothed cross-entropy (eps 0 is plain FedAvg)."""

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        eps = self.cfg["algorithm.smooth_fedavg.eps"]
        return nn.functional.cross_entropy(self.model(x), y, label_smoothing=eps)


algorithms.register("smooth_fedavg", Algorithm(SmoothTrainer, Aggregator))
