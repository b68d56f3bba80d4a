"""Replacing how an aggregator combines updates, without touching the aggregator.

Robust rules and central DP change one thing in a FedAvg-style aggregation:
how the clients' updates become one. `replace_combination` wraps an
aggregator's `aggregate`: the received models become deltas from the current
global state, a rule turns the deltas into one delta, and the original
`aggregate` receives a single update carrying `global + delta` (its weighted
mean of one update is that update). Whatever the aggregator does after the
mean (server momentum, an outer optimizer, bookkeeping) still happens.
"""
from __future__ import annotations

from typing import Callable

import torch

from fedcore.kernel.contract import Aggregator, ReceivedUpdate, weighted_mean
from fedcore.kernel.hooks import Wrapper

__all__ = ["Deltas", "CombineRule", "replace_combination", "flatten", "unflatten", "float_names"]

Deltas = list[dict[str, torch.Tensor]]
# (deltas of floating entries, sample weights, client ids, round) -> (one delta, metrics)
CombineRule = Callable[[Deltas, list[float], list[int], int], tuple[dict[str, torch.Tensor], dict]]


def float_names(model: dict[str, torch.Tensor]) -> list[str]:
    """Entries that rules act on; integer buffers (BatchNorm counters) are averaged as usual."""
    return [k for k, v in model.items() if v.is_floating_point()]


def flatten(delta: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """One float64 vector of the named entries (norms and distances in full precision)."""
    if not names:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([delta[n].reshape(-1).to(torch.float64) for n in names])


def unflatten(vec: torch.Tensor, like: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Split a vector back into new tensors shaped (and typed) like `like`."""
    out, pos = {}, 0
    for n in names:
        t = like[n]
        out[n] = vec[pos:pos + t.numel()].reshape(t.shape).to(t.dtype).clone()
        pos += t.numel()
    return out


def replace_combination(aggregator: Aggregator, rule: CombineRule, label: str,
                        others: str = "mean") -> None:
    """Make `aggregator` combine updates with `rule` (applied before its own aggregate). The
    entries the rule does not combine (integers: a batch norm's counter) are the updates'
    weighted mean, or with `others="global"` kept as the global model has them (central DP
    releases nothing it has not noised)."""
    def aggregate(original, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        if not updates:
            return original(updates, round_)
        extra = set(updates[0].content) - {"model", "num_samples"}
        if extra:
            raise RuntimeError(f"{label} combines models only, but updates also carry "
                               f"{sorted(extra)}; this algorithm's aggregation cannot be replaced")
        base = aggregator.global_state
        models = [u.content["model"] for u in updates]
        names = float_names(models[0])
        # the aggregator's own weights: its weighting rule (e.g. DiLoCo's uniform) and, in an
        # asynchronous course, the staleness discount
        weights = [float(w) for w in aggregator.weights(updates)]
        if sum(weights) <= 0:
            weights = [1.0] * len(updates)
        deltas = [{n: m[n].to(torch.float64) - base[n].to(torch.float64) for n in names} for m in models]
        delta, metrics = rule(deltas, weights, [u.client_id for u in updates], round_)
        combined = {}
        for n in models[0]:
            if n in delta:
                combined[n] = (base[n].to(torch.float64) + delta[n]).to(base[n].dtype)
            elif others == "global":
                combined[n] = base[n]
            else:
                combined[n] = weighted_mean([m[n] for m in models], weights)
        one = ReceivedUpdate(updates[0].client_id, {"model": combined, "num_samples": sum(weights)},
                             updates[0].round, updates[0].staleness)
        out = dict(original([one], round_) or {})
        out.update(metrics)
        return out

    aggregator.wrap(Wrapper(label, "aggregate", aggregate))
    aggregator.combination = label   # the rule needs every update at once (algorithms/streaming.py)
