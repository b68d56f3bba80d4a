"""A passive SplitNN party whose activations carry one column more than the cut: the project's
own bottom model with its output stage changed. Loaded by that party's process only, through
`plugins: [tests.vertical_attacker]` (tests/test_deploy_vertical.py)."""
from __future__ import annotations

import torch

from fedcore.algorithms.splitnn import BottomParty
from fedcore.kernel.registry import components


class WiderActivations(BottomParty):
    def forward(self, step: int) -> torch.Tensor:
        h = super().forward(step)
        return torch.cat([h, h[:, :1]], dim=1)


components.register("splitnn_bottom", WiderActivations)
