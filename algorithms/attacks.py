"""What malicious clients do to their data and to the update they send.

Data poisoning: `flip_labels` (y -> C - 1 - y) and `add_trigger` (a pixel
pattern: the bottom-right `size` x `size` patch of an image set to `value`, or
the last `size` features of a vector input). Model poisoning acts on the
delta d = w_trained - w_received: `sign_flip` sends w - s d, `scale_update`
sends w + s d (scaled replacement, Bagdasaryan et al., 2020), `gaussian_update`
sends w + N(0, std^2) per coordinate, and `drift_update` sends w + s ||d|| e along
one fixed unit direction e every round: an update sized like an honest one (s
below admission's 10x bound), so no round refuses it, that pulls the model the
same way round after round.
"""
from __future__ import annotations

import torch

from fedcore.algorithms.combine import float_names
from fedcore.scenarios.data import ClientData, Split

__all__ = ["flip_labels", "add_trigger", "poison_backdoor", "sign_flip", "scale_update",
           "gaussian_update", "fixed_direction", "drift_update"]


def flip_labels(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Label flipping: class c becomes C - 1 - c."""
    return (num_classes - 1) - y


def add_trigger(x: torch.Tensor, size: int, value: float) -> torch.Tensor:
    """A copy of `x` (a batch) with the trigger pattern stamped on every sample."""
    out = x.clone()
    if out.dim() >= 3:  # images: (N, [C,] H, W), bottom-right patch
        out[..., -size:, -size:] = value
    else:
        out.reshape(len(out), -1)[:, -size:] = value
    return out


def poison_backdoor(data: ClientData, ratio: float, target: int, size: int, value: float,
                    generator: torch.Generator) -> ClientData:
    """`data` with a `ratio` share of its training samples triggered and relabelled `target`."""
    train = data.train
    n = len(train)
    k = int(round(ratio * n))
    idx = torch.randperm(n, generator=generator)[:k]
    x, y = train.x.clone(), train.y.clone()
    x[idx] = add_trigger(x[idx], size, value)
    y[idx] = target
    return ClientData(Split(x, y), data.val, data.test)


def _map_delta(model: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], fn) -> dict:
    out = dict(model)
    for n in float_names(model):
        d = model[n].to(torch.float64) - reference[n].to(torch.float64)
        out[n] = (reference[n].to(torch.float64) + fn(n, d)).to(model[n].dtype)
    return out


def sign_flip(model: dict, reference: dict, scale: float) -> dict:
    """w_received - scale * delta."""
    return _map_delta(model, reference, lambda n, d: -scale * d)


def scale_update(model: dict, reference: dict, scale: float) -> dict:
    """w_received + scale * delta."""
    return _map_delta(model, reference, lambda n, d: scale * d)


def gaussian_update(model: dict, reference: dict, std: float, generator: torch.Generator) -> dict:
    """w_received + N(0, std^2): an update of pure noise."""
    return _map_delta(model, reference, lambda n, d: torch.randn(
        d.shape, generator=generator, dtype=torch.float64).to(d.device) * std)


def fixed_direction(model: dict, generator: torch.Generator) -> dict:
    """A random unit vector over the model's floating entries (float64), drawn once."""
    names = float_names(model)
    e = {n: torch.randn(model[n].shape, generator=generator, dtype=torch.float64) for n in names}
    norm = torch.sqrt(sum((t * t).sum() for t in e.values()))
    return {n: t / norm for n, t in e.items()}


def drift_update(model: dict, reference: dict, scale: float, direction: dict) -> dict:
    """w_received + scale * ||delta|| * direction: the honest update's size, a fixed direction."""
    names = float_names(model)
    size = torch.sqrt(sum(((model[n].to(torch.float64) - reference[n].to(torch.float64)) ** 2).sum()
                          for n in names)) if names else 0.0
    return _map_delta(model, reference, lambda n, d: scale * size * direction[n].to(d.device))
