"""Models with BatchNorm layers (for FedBN, which keeps those layers local)."""
from __future__ import annotations

import math

from torch import nn
from torch.nn import functional as F

from fedcore.kernel.registry import models

__all__ = ["mlp_bn", "cnn_bn", "BatchNorm1d"]


class BatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d that normalizes a one-sample training batch with its running statistics
    (a client's last mini-batch of an epoch can hold a single sample)."""

    def forward(self, x):
        if self.training and x.shape[0] == 1:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        return super().forward(x)


@models.register("mlp_bn")
def mlp_bn(cfg, input_shape, num_classes: int) -> nn.Module:
    """`mlp` with BatchNorm1d after each hidden linear layer."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in cfg["model.hidden"]:
        layers += [nn.Linear(width, int(h)), BatchNorm1d(int(h)), nn.ReLU()]
        width = int(h)
    layers.append(nn.Linear(width, 1 if cfg["train.loss"] == "mse" else num_classes))
    return nn.Sequential(*layers)


@models.register("cnn_bn")
def cnn_bn(cfg, input_shape, num_classes: int) -> nn.Module:
    """Two 3x3 conv + BatchNorm2d + ReLU + max-pool blocks and a linear head (images)."""
    if len(input_shape) == 2:
        input_shape = (1, *input_shape)
    c, h, w = input_shape
    body = nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten())
    return nn.Sequential(_AddChannel(len(input_shape)), body,
                         nn.Linear(32 * (h // 4) * (w // 4), num_classes))


class _AddChannel(nn.Module):
    """(N, H, W) images become (N, 1, H, W); (N, C, H, W) pass through."""

    def __init__(self, dims: int):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return x.unsqueeze(1) if x.dim() == 3 else x
