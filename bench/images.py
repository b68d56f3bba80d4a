"""The image task and LeNet-5, with torch alone (no fedcore), so that scripts which run
another framework (`bench.w6_flower`) make exactly the same data and model."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["INPUT_SHAPE", "NUM_CLASSES", "class_templates", "image_samples", "LeNet5"]

INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


def class_templates(seed: int) -> torch.Tensor:
    """One smooth 28x28 pattern per class (a random 7x7 grid, bilinearly enlarged)."""
    g = torch.Generator().manual_seed(seed * 7919 + 2)
    coarse = torch.randn((NUM_CLASSES, 1, 7, 7), generator=g)
    return nn.functional.interpolate(coarse, size=INPUT_SHAPE[1:], mode="bilinear", align_corners=False)


def image_samples(seed: int, client_id: int, n: int, templates: torch.Tensor,
                  noise: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Client `client_id`'s n images and labels: its class's pattern under Gaussian noise (a
    task a convnet learns in tens of rounds), from `seed + client_id` alone."""
    g = torch.Generator().manual_seed(seed + client_id)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    x = templates[y] + noise * torch.randn((n,) + INPUT_SHAPE, generator=g)
    return x, y


class LeNet5(nn.Module):
    """LeNet-5 for 1x28x28 inputs (padding 2 on the first convolution), ReLU and max-pooling."""

    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
