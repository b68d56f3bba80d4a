"""Gradient inversion recovers a sample from its gradient; DP noise on the gradient prevents it."""
import torch
from torch import nn

from fedcore.algorithms.dp import privatize
from fedcore.algorithms.inversion import infer_label, invert_gradient, sample_gradient


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Sigmoid(), nn.Linear(12, 3)).double()
    x = torch.randn(1, 6, dtype=torch.float64)
    return model, x, torch.tensor([2])


def test_idlg_reads_the_label_off_the_last_layer():
    model, x, y = _setup()
    for label in range(3):
        assert infer_label(model, sample_gradient(model, x, torch.tensor([label]))) == label


def test_dlg_reconstructs_the_input_and_dp_noise_prevents_it():
    model, x, y = _setup()
    grads = sample_gradient(model, x, y)
    x_hat, label = invert_gradient(model, grads, (6,), iterations=15)
    assert label == 2
    clean_err = (x_hat - x).pow(2).mean().item()
    assert clean_err < 1e-4
    # the same gradient released with DP (clip at its own norm, sigma = 0.5)
    named = {str(i): g for i, g in enumerate(grads)}
    zero = {k: torch.zeros_like(v) for k, v in named.items()}
    norm = sum(g.pow(2).sum() for g in grads).sqrt().item()
    noisy, _ = privatize(named, zero, norm, 0.5, torch.Generator().manual_seed(3))
    x_dp, _ = invert_gradient(model, [noisy[str(i)] for i in range(len(grads))], (6,), iterations=15)
    assert (x_dp - x).pow(2).mean().item() > 1000 * clean_err
    assert (x_dp - x).pow(2).mean().item() > 0.05
