"""Replacing how an aggregator combines updates, without touching the aggregator.

Robust rules and central DP change one thing in a FedAvg-style aggregation:
how the clients' updates become one. `replace_combination` wraps an
aggregator's `aggregate`: the received models become deltas from the current
global state, a rule turns the deltas into one delta, and the original
`aggregate` receives a single update carrying `global + delta` (its weighted
mean of one update is that update). Whatever the aggregator does after the
mean (server momentum, an outer optimizer, bookkeeping) still happens.

A rule needs every update of the round at once, but not all of each: a `BandedRule` (the
robust rules) reads the round's deltas as the rows of a k x N float64 matrix a band of
columns at a time (`Columns`) and gives its result band by band, which goes straight into
the new model. Past `ONE_BAND` values a band's block takes at most `BAND_BYTES`, so the rule
holds that and the new model, not k float64 copies of the model, however many clients send
(a deployed server's spooled updates give each band's pages back once read,
wire/spooled.py). A model of at most `ONE_BAND` floating values is one band: the very
computation of the whole matrix.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from fedcore.kernel.contract import Aggregator, ReceivedUpdate, weighted_mean
from fedcore.kernel.hooks import Wrapper
from fedcore.wire.spooled import release

__all__ = ["Deltas", "CombineRule", "Columns", "BandedRule", "replace_combination", "flatten",
           "unflatten", "float_names", "models_only", "COMBINED"]

ONE_BAND = 2 ** 21     # a model of at most this many floating values is read as one band
BAND_BYTES = 2 ** 23   # beyond that, a band's k x width float64 block takes at most 8 MiB, whatever k
MIN_BAND = 2 ** 12     # columns of a band at least, however many rows

# an update's entry that marks it as a folding round's result of the rule (algorithms/dp_fold.py),
# carrying the rule's metrics: the aggregator takes its model as it is
COMBINED = "combined_by_rule"

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


class Columns:
    """The rows x_i - g (each row's floating entries `names` in order, in float64) of the k
    updates `rows` against the global model `base` (None: the rows are deltas already), read a
    band of columns at a time. `n` columns in all; a matrix of at most ONE_BAND columns is
    one band, read once and kept."""

    def __init__(self, rows: list[dict[str, torch.Tensor]], names: list[str],
                 base: dict[str, torch.Tensor] | None = None) -> None:
        self.rows, self.names, self.base = rows, names, base
        self.spans: list[tuple[str, int, int]] = []
        at = 0
        for name in names:
            size = rows[0][name].numel()
            self.spans.append((name, at, at + size))
            at += size
        self.n = at
        self.single = self.n <= ONE_BAND
        self.width = self.n if self.single else max(MIN_BAND, BAND_BYTES // (8 * len(rows)))
        self.device = rows[0][names[0]].device if names else torch.device("cpu")
        self._kept: torch.Tensor | None = None

    def bands(self) -> Iterator[tuple[int, int]]:
        """(start, stop) of each band of columns (one empty band where there are no columns)."""
        if self.single:
            yield 0, self.n
            return
        for start in range(0, self.n, self.width):
            yield start, min(start + self.width, self.n)

    def band(self, start: int, stop: int) -> torch.Tensor:
        """The k x (stop - start) float64 block of the matrix."""
        if self.single and self._kept is not None:
            return self._kept
        rows = []
        for row in self.rows:
            parts = []
            for name, lo, hi in self._overlapping(start, stop):
                x = row[name].reshape(-1)[lo:hi]
                part = x.to(torch.float64)
                if self.base is not None:
                    part = part - self.base[name].reshape(-1)[lo:hi].to(torch.float64)
                release(x)   # a spooled update's pages go back once read
                parts.append(part)
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts) if parts
                        else torch.zeros(0, dtype=torch.float64))
        block = torch.stack(rows)
        if self.single:
            self._kept = block
        return block

    def _overlapping(self, start: int, stop: int) -> Iterator[tuple[str, int, int]]:
        """(entry, from, to) of each entry's flat slice within columns [start, stop)."""
        for name, lo, hi in self.spans:
            if hi > start and lo < stop or lo == hi == start == stop:
                yield name, max(start, lo) - lo, min(stop, hi) - lo

    def scatter(self, start: int, stop: int, values: torch.Tensor, into: dict[str, torch.Tensor]) -> None:
        """Write columns [start, stop) of a result vector into `into`'s entries (flat, contiguous):
        g + values where there is a base (a delta made a model again, in the entry's dtype)."""
        at = 0
        for name, lo, hi in self._overlapping(start, stop):
            part = values[at:at + hi - lo]
            if self.base is not None:
                part = (self.base[name].reshape(-1)[lo:hi].to(torch.float64) + part)
            into[name].view(-1)[lo:hi] = part
            at += hi - lo


class BandedRule:
    """A rule that reads the deltas a band at a time: `combine(columns, weights, client_ids,
    round, emit)` calls `emit(start, stop, values)` with the combined delta of each band and
    returns the round's metrics. Called as a plain `CombineRule` on a list of delta dicts, it
    gives the combined delta dict."""

    def __init__(self, combine: Callable[..., dict]) -> None:
        self.combine = combine

    def __call__(self, deltas: Deltas, weights: list[float], client_ids: list[int], round_: int):
        names = list(deltas[0])
        columns = Columns(deltas, names)
        out = {n: torch.empty(deltas[0][n].shape, dtype=deltas[0][n].dtype, device=deltas[0][n].device)
               for n in names}
        metrics = self.combine(columns, weights, client_ids, round_,
                               lambda a, b, v: columns.scatter(a, b, v, out))
        return out, metrics


def models_only(update: ReceivedUpdate, label: str) -> None:
    """Refuse (RuntimeError) an update that carries more than a model: a rule that replaces
    the combination cannot combine the rest."""
    extra = set(update.content) - {"model", "num_samples"}
    if extra:
        raise RuntimeError(f"{label} combines models only, but updates also carry "
                           f"{sorted(extra)}; this algorithm's aggregation cannot be replaced")


def replace_combination(aggregator: Aggregator, rule: CombineRule, label: str,
                        others: str = "mean") -> None:
    """Make `aggregator` combine updates with `rule` (applied before its own aggregate). The
    entries the rule does not combine (integers: a batch norm's counter) are the updates'
    weighted mean, or with `others="global"` kept as the global model has them (central DP
    releases nothing it has not noised). A rule that folds (`rule.fold`, algorithms/dp_fold.py)
    folds the updates here in their order, as a folding round does as they arrive; that
    round's one update (`COMBINED`) is its result already."""
    def aggregate(original, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        if not updates:
            return original(updates, round_)
        if len(updates) == 1 and COMBINED in updates[0].content:
            content = dict(updates[0].content)
            metrics = content.pop(COMBINED)
            one = ReceivedUpdate(updates[0].client_id, content, updates[0].round, updates[0].staleness,
                                 owned=updates[0].owned)
            return {**(original([one], round_) or {}), **metrics}
        models_only(updates[0], label)
        base = aggregator.global_state
        models = [u.content["model"] for u in updates]
        names = float_names(models[0])
        # the aggregator's own weights: its weighting rule (e.g. DiLoCo's uniform) and, in an
        # asynchronous course, the staleness discount
        weights = [float(w) for w in aggregator.weights(updates)]
        if sum(weights) <= 0:
            weights = [1.0] * len(updates)
        ids = [u.client_id for u in updates]
        if isinstance(rule, BandedRule):   # the deltas read a band at a time, the model written so
            columns = Columns(models, names, base)
            new = {n: torch.empty(base[n].shape, dtype=base[n].dtype, device=base[n].device) for n in names}
            metrics = rule.combine(columns, weights, ids, round_, lambda a, b, v: columns.scatter(a, b, v, new))
        elif folding:   # the updates folded one by one, the new model written as it is released
            total = rule.start()
            for model, client, w in zip(models, ids, weights):
                rule.fold(total, model, base, client, w)
            new, metrics = rule.release(total, round_, base)
        else:
            deltas = [{n: m[n].to(torch.float64) - base[n].to(torch.float64) for n in names} for m in models]
            delta, metrics = rule(deltas, weights, ids, round_)
            new = {n: (base[n].to(torch.float64) + d).to(base[n].dtype) for n, d in delta.items()}
        combined = {}
        for n in models[0]:
            if n in new:
                combined[n] = new[n]
            elif others == "global":
                combined[n] = base[n]
            else:
                combined[n] = weighted_mean([m[n] for m in models], weights)
        one = ReceivedUpdate(updates[0].client_id, {"model": combined, "num_samples": sum(weights)},
                             updates[0].round, updates[0].staleness)
        out = dict(original([one], round_) or {})
        out.update(metrics)
        return out

    folding = callable(getattr(rule, "fold", None))
    aggregator.wrap(Wrapper(label, "aggregate", aggregate))
    if folding:
        aggregator.folding_rule = rule   # a folding round may fold its updates as they arrive
    aggregator.combination = label   # the rule needs every update at once (algorithms/streaming.py)
