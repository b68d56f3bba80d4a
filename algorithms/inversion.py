"""Gradient inversion (DLG, Zhu et al., 2019; iDLG, Zhao et al., 2020).

A client that shares the gradient of one sample's loss leaks the sample: the
attacker looks for an input whose gradient (under the same model and label)
matches the shared one, minimising ||grad(x', y) - g||^2 over x' with L-BFGS.
iDLG first reads the label off the last layer: for cross-entropy on one
sample, the output bias gradient is softmax - onehot, negative only at the
true class. Adding DP noise to the shared gradient leaves nothing to match,
which `scenarios/dlg_demo.py` shows.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["sample_gradient", "infer_label", "invert_gradient"]


def sample_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The cross-entropy gradient of `model`'s parameters on the batch (x, y)."""
    loss = nn.functional.cross_entropy(model(x), y)
    return [g.detach() for g in torch.autograd.grad(loss, [p for p in model.parameters()])]


def infer_label(model: nn.Module, grads: list[torch.Tensor]) -> int:
    """iDLG: the class whose output-layer gradient is negative (one-sample batches)."""
    params = list(model.parameters())
    last_bias = grads[-1] if params[-1].dim() == 1 else None
    if last_bias is not None:
        return int(last_bias.argmin().item())
    return int(grads[-1].sum(dim=1).argmin().item())


def invert_gradient(model: nn.Module, grads: list[torch.Tensor], input_shape: tuple[int, ...],
                    label: int | None = None, iterations: int = 50,
                    seed: int = 0) -> tuple[torch.Tensor, int]:
    """Reconstruct a one-sample input from its shared gradient; returns (x', label used)."""
    if label is None:
        label = infer_label(model, grads)
    params = list(model.parameters())
    dtype = params[0].dtype
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((1, *input_shape), generator=g, dtype=dtype).requires_grad_(True)
    y = torch.tensor([label])
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=20, history_size=50,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        dummy = torch.autograd.grad(loss, params, create_graph=True)
        dist = sum(((d - t) ** 2).sum() for d, t in zip(dummy, grads))
        dist.backward()
        return dist
    for _ in range(iterations):
        opt.step(closure)
    return x.detach(), label
