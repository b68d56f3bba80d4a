"""What every trainer and aggregator computes alike: the weighted mean of updates, a model's
loss and accuracy on a split, the device a model lives on, and copies of state trees that
share no storage. Part of the plug-in contract (`fedcore.kernel.contract` exports them too)."""
from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["weighted_mean", "evaluate_model", "model_device", "clone_tree", "tensors_in", "first_non_finite"]


_STACK_LIMIT = 64 * 2 ** 20   # bytes: updates are stacked for one matrix-vector product up to this


def weighted_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i w_i t_i / sum_i w_i; integer tensors are averaged in float64 and rounded back.

    Floating-point tensors are taken as the rows of one matrix and averaged with one
    matrix-vector product: a view of their common storage when they are consecutive rows
    of one tensor (a vectorised group's updates), else a stacked copy (up to `_STACK_LIMIT`
    bytes; beyond that, one fused add per tensor, without the copy). Both matrices hold the
    same numbers in the same layout, so the result does not depend on how the updates were made.
    """
    total = float(sum(weights))
    ref = tensors[0]
    if len(tensors) == 1 and total > 0:
        # w t / w is t itself (x * 1.0 is exact; an integer exactly, not through float64): a
        # copy, without the stacked one and the product (a folding round's mean arrives as one
        # update: two models less at its aggregation)
        return ref.clone()
    if not ref.is_floating_point():
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for t, w in zip(tensors, weights):
            acc.add_(t.to(torch.float64), alpha=w / total)
        return acc.round().to(ref.dtype)
    rows = _rows(tensors)
    if rows is None:
        acc = torch.zeros(ref.shape, dtype=ref.dtype, device=ref.device)
        for t, w in zip(tensors, weights):
            acc.add_(t.to(ref.dtype), alpha=w / total)
        return acc
    coef = torch.tensor([w / total for w in weights], dtype=ref.dtype, device=ref.device)
    return (coef @ rows).reshape(ref.shape)


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as the rows of one [k, numel] matrix, or None where that would need a copy
    of more than `_STACK_LIMIT` bytes (or they differ in dtype or shape)."""
    ref = tensors[0]
    k, m = len(tensors), ref.numel()
    dtype, shape = ref.dtype, ref.shape
    base = ref._base
    if base is not None and m > 0 and base.is_contiguous():
        # consecutive rows of one tensor: the matrix is a view of it (checked with one
        # C-level pass per property: this runs for every entry of every aggregation)
        start = ref.storage_offset()
        if list(map(_STORAGE_OFFSET, tensors)) == list(range(start, start + k * m, m)) \
                and all(b is base for b in map(_BASE, tensors)) \
                and all(map(_CONTIGUOUS, tensors)) and all(s == shape for s in map(_SHAPE, tensors)):
            return base.view(-1)[start - base.storage_offset():][:k * m].view(k, m)
    if any(t.dtype != dtype or t.shape != shape for t in tensors) \
            or k * m * ref.element_size() > _STACK_LIMIT:
        return None
    return torch.stack(tensors).view(k, m)


_STORAGE_OFFSET, _CONTIGUOUS = torch.Tensor.storage_offset, torch.Tensor.is_contiguous
_BASE, _SHAPE = operator.attrgetter("_base"), operator.attrgetter("shape")


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (the CPU for an empty model)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


def evaluate_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str,
                   batch_size: int = 1024) -> dict[str, float]:
    """Mean loss and (for classification) accuracy of `model` on (x, y); with a target per
    position (y [N, T], a language model's next tokens) they are per token, with perplexity."""
    n = len(y)
    if n == 0:
        return {}
    if y.dim() == 2 and loss != "mse":
        return _evaluate_tokens(model, x, y, batch_size)
    was_training = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    device = model_device(model)
    with torch.no_grad():
        for start in range(0, n, batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            if xb.device != device:   # data kept in CPU memory: moved one batch at a time
                xb, yb = xb.to(device), yb.to(device)
            out = model(xb)
            if loss == "mse":
                total_loss += nn.functional.mse_loss(out.reshape(yb.shape), yb, reduction="sum").item()
            else:
                total_loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
                correct += (out.argmax(1) == yb).sum().item()
    model.train(was_training)
    result = {"loss": total_loss / n, "n": n}
    if loss != "mse":
        result["acc"] = correct / n
    return result


def _evaluate_tokens(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     batch_size: int) -> dict[str, float]:
    """Token-level loss, next-token accuracy and perplexity exp(loss) of logits [B, V, T]."""
    was_training = model.training
    model.eval()
    total_loss, correct, device = 0.0, 0, model_device(model)
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb, yb = x[start:start + batch_size].to(device), y[start:start + batch_size].to(device)
            out = model(xb)
            total_loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
            correct += (out.argmax(1) == yb).sum().item()
    model.train(was_training)
    tokens = y.numel()
    mean = total_loss / tokens
    return {"loss": mean, "acc": correct / tokens, "perplexity": math.exp(min(mean, 700.0)),
            "n": len(y)}


def clone_tree(obj: Any) -> Any:
    """A copy of a state_dict tree whose tensors share no storage with the original."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def tensors_in(obj: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in a state tree (dicts, lists, tuples), however nested."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_in(v, f"{where}.{k}" if where else str(k))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield from tensors_in(v, f"{where}[{i}]")


def first_non_finite(obj: Any, where: str = "") -> str | None:
    """The name of the first tensor in a state tree holding NaN or an infinity (None: none
    does): the finiteness check an aggregate passes (`fedcore.runtime.admission`), for what is
    read back from disk."""
    from fedcore.wire.tensor_forms import get_form
    finite = get_form("torch").all_finite
    return next((name for name, t in tensors_in(obj, where) if not finite(t)), None)
