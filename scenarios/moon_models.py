"""Models with the shape MOON needs: encoder -> projection head -> classifier.

As in the MOON authors' reference model, the projection head is two linear
layers with a ReLU between them, and the classifier reads the projection
output. `forward(x)` returns logits, so any algorithm can train these models;
`project_and_classify(x)` returns (z, logits) from one pass for MOON's
contrastive term. Builders carry `moon_ready = True`, which MOON's config
check looks for (a plug-in model can set it too).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fedcore.kernel.config import declare, positive
from fedcore.kernel.registry import models

__all__ = ["MoonNet", "moon_mlp", "moon_cnn"]

declare("model.moon.proj_dim", int, 256, "moon_mlp/moon_cnn: width of the projection output z",
        check=positive)


class MoonNet(nn.Module):
    """encoder -> head (Linear, ReLU, Linear) -> classifier on the projection."""

    def __init__(self, encoder: nn.Module, feature_dim: int, proj_dim: int, out_dim: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Sequential(nn.Linear(feature_dim, feature_dim), nn.ReLU(),
                                  nn.Linear(feature_dim, proj_dim))
        self.classifier = nn.Linear(proj_dim, out_dim)

    def project_and_classify(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.head(self.encoder(x))
        return z, self.classifier(z)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.project(x))


def _outputs(cfg, num_classes: int) -> int:
    return 1 if cfg["train.loss"] == "mse" else num_classes


@models.register("moon_mlp")
def moon_mlp(cfg, input_shape, num_classes: int) -> nn.Module:
    """ReLU MLP encoder with `model.hidden` widths (none: the flattened input is the feature)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in cfg["model.hidden"]:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        width = int(h)
    return MoonNet(nn.Sequential(*layers), width, cfg["model.moon.proj_dim"], _outputs(cfg, num_classes))


moon_mlp.moon_ready = True


@models.register("moon_cnn")
def moon_cnn(cfg, input_shape, num_classes: int) -> nn.Module:
    """The reference's simple CNN encoder (conv 6@5x5, pool, conv 16@5x5, pool, fc 120, fc 84)."""
    if len(input_shape) != 3:
        from fedcore.kernel.errors import ConfigError
        raise ConfigError(f"model.type: moon_cnn needs image inputs (C, H, W), the data has shape "
                          f"{tuple(input_shape)}; use moon_mlp")
    conv = nn.Sequential(nn.Conv2d(input_shape[0], 6, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    with torch.no_grad():
        flat = conv(torch.zeros(1, *input_shape)).shape[1]
    encoder = nn.Sequential(conv, nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
    return MoonNet(encoder, 84, cfg["model.moon.proj_dim"], _outputs(cfg, num_classes))


moon_cnn.moon_ready = True
