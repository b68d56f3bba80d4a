"""Central DP folded: each update's clipped delta joins a running float64 sum as it arrives.

Central DP (DP-FedAvg, adaptive clipping) needs of a round's updates only the sum of their
clipped deltas, sum_i clip(x_i - g, C), and, for the metrics and adaptive clipping, how many
were clipped or stayed below C. So an update is folded at once: one float64 pass over its
delta x_i - g, a slice at a time, gives its norm; a second adds factor * (x_i - g) into the
sum, a slice at a time, and the update is let go. At the round's end, once, the noise is
added to the sum, the total divided by m and added to g, a slice at a time, each slice cast
to the model's dtype as it is made: the server holds the global model, the float64 sum
(twice a float32 model: in a file where `aggregator.spill` applies) and the next model as it
is written over the sum's freed pieces, whatever the clients per round.

The list-based round (`aggregator.streaming: off`, an empty round) runs the very same fold
over its updates in client-id order, so the two are equal bit for bit where the updates are
folded in the same order, and to float64 rounding of the sum before its one cast otherwise.
The noise is the same draws too: `NoiseStream` draws the flattened entries' N(0, 1) in
blocks whose sizes are multiples of 16 with a last block of at least 16, which reproduces one
`torch.randn(numel)` from the same generator, and leaves the generator where that one draw
would (tests/test_dp_fold.py checks it over many sizes).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from fedcore.algorithms import streaming
from fedcore.algorithms.dp_noise import standard_normal
from fedcore.wire.spooled import is_mapped, release

__all__ = ["ClippedSum", "NoiseStream", "FoldingRule", "NOISE_BLOCK"]

NOISE_BLOCK = 2 ** 20   # N(0, 1) values drawn at a time (a multiple of 16: see NoiseStream)


def _delta(x: torch.Tensor, g: torch.Tensor | None, at: int, n: int, out: torch.Tensor) -> torch.Tensor:
    """x - g over flat elements [at, at + n) in float64 (x itself where g is None), written
    into `out` (no allocation per slice), pages of a spooled update or parked model given back
    once read. The same roundings as x.double() - g.double(): both casts are exact."""
    part, d = x.reshape(-1)[at:at + n], out[:n]
    d.copy_(part)
    release(part)
    if g is not None:
        base = g.reshape(-1)[at:at + n]
        d.sub_(base)
        release(base)
    return d


class ClippedSum(streaming.RunningMean):
    """sum_i clip(x_i - g, C_i) over the floating entries, in float64 pieces (spilled as a
    folding round's sum is), with the counts the metrics need and the updates' total weight."""

    def __init__(self, spill: bool = False, folder: str | None = None) -> None:
        super().__init__(spill=spill, folder=folder)
        self.keys: list[str] = []        # the updates' entries, in their order
        self.names: list[str] = []       # their floating entries (the flattened vector's order)
        self.folded = self.present = self.below = self.clipped = 0

    def add(self, model: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None, clip: float,
            client: int, weight: float = 1.0) -> float:
        """Fold clip(model - base, clip) (model itself as the delta where base is None); client 0
        (the server's own model on an empty round) is not counted. Returns the delta's norm."""
        if self.sum is None:
            self.keys = list(model)
            self.names = [n for n in self.keys if model[n].is_floating_point()]
            self.start({n: model[n] for n in self.names})
        base_of = (lambda n: None) if base is None else base.__getitem__
        device = model[self.names[0]].device if self.names else torch.device("cpu")
        largest = max((model[n].numel() for n in self.names), default=0)
        buf = torch.empty(min(streaming.FOLD_STEP, largest), dtype=torch.float64, device=device)
        squares = 0.0
        for name in self.names:
            for _, lo, hi, at in streaming.sum_slices(model[name].numel()):
                d = _delta(model[name], base_of(name), at, hi - lo, buf)
                squares += float(torch.dot(d, d))
        norm = math.sqrt(squares)
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        for name in self.names:
            pieces = self.sum[name]
            for index, lo, hi, at in streaming.sum_slices(model[name].numel()):
                acc = pieces[index][lo:hi]
                acc.add_(_delta(model[name], base_of(name), at, hi - lo, buf).mul_(factor))
                release(acc)   # a spilled sum's pages go back to its file
        self.folded += 1
        self.total += max(weight, 0.0)
        if client != 0:
            self.present += 1
            self.below += norm <= clip
            self.clipped += norm > clip
        return norm

    @property
    def weight(self) -> float:
        return self.total if self.total > 0 else float(self.folded)

    def release_into(self, std: float, source, m: float, base: dict[str, torch.Tensor] | None
                     ) -> dict[str, torch.Tensor]:
        """base + (sum + N(0, std^2)) / m for each floating entry, cast to its dtype (float64
        deltas where base is None), the noise drawn over the entries in order; each piece of
        the sum is let go once written. Releases the sum."""
        sums, self.sum = self.sum or {}, None
        numel = sum(self.like[n][1].numel() for n in self.names)
        noise = NoiseStream(numel, source) if std > 0 and numel else None
        spilled = base is not None and sums and all(is_mapped(p[0]) for p in sums.values() if p)
        files = self._blank_mean() if spilled else {}
        out = {}
        for name in self.names:
            dtype, shape, device = self.like[name]
            dtype = dtype if base is not None else torch.float64
            new = files.get(name)
            new = torch.empty(shape, dtype=dtype, device=device) if new is None else new
            flat, pieces = new.view(-1), sums.pop(name)
            for index, lo, hi, at in streaming.sum_slices(new.numel()):
                acc = part = pieces[index][lo:hi]
                if noise is not None:
                    acc.add_(noise.take(hi - lo).to(acc.device) * std)
                acc.div_(m)
                if base is not None:
                    g = base[name].reshape(-1)[at:at + hi - lo]
                    acc = g.to(torch.float64) + acc
                    release(g)
                flat[at:at + hi - lo].copy_(acc)
                release(part)   # a spilled sum's pages go back to its file, and the new model's
                release(flat[at:at + hi - lo])
                if hi == pieces[index].numel():
                    pieces[index] = None     # this piece of the sum is let go
            out[name] = new
        return out


class NoiseStream:
    """`numel` N(0, 1) draws from `source`, taken a slice at a time, equal to one
    `standard_normal(numel, source)`.

    torch's CPU normal fills a tensor of 16 or more values with uniforms, turns each block of
    16 into normals (Box-Muller), and where numel % 16 != 0 draws 16 more uniforms for the
    last 16 values; fewer than 16 are drawn one by one. So blocks that are multiples of 16,
    the last one at least 16, draw the same uniforms in the same order and give the same
    values. OS noise is fresh at every draw, whatever the blocks."""

    def __init__(self, numel: int, source, block: int | None = None) -> None:
        block = block or NOISE_BLOCK
        if block % 16 or block < 16:
            raise ValueError(f"a noise block must be a positive multiple of 16, not {block}")
        self.left, self.source, self.block = numel, source, block
        self.kept = torch.zeros(0, dtype=torch.float64)

    def take(self, n: int) -> torch.Tensor:
        while self.kept.numel() < n:
            if self.left <= 0:
                raise ValueError("the noise stream is exhausted")
            size = min(self.block, self.left)
            if self.left - size < 16:   # a last block of fewer than 16 would be drawn otherwise
                size = self.left
            self.left -= size
            drawn = standard_normal(size, self.source)
            self.kept = drawn if not self.kept.numel() else torch.cat([self.kept, drawn])
        out, self.kept = self.kept[:n], self.kept[n:]
        return out


class FoldingRule:
    """A central-DP combination rule in its two forms: a `combine.CombineRule` over a list of
    deltas, and a fold (`start`, `fold`, `combined`) that a folding round uses one update at a
    time. Subclasses say the clip norm (`clip`), the divisor (`m`, None: the number folded),
    the noise's std on the sum (`std`) and what follows the noise (`after`)."""

    clip: float
    m: float | None = None
    noise: Callable[[int], Any]

    def std(self) -> float:
        raise NotImplementedError

    def after(self, total: ClippedSum, source) -> dict[str, Any]:
        """The round's metrics, once the sum's noise is drawn (adaptive clipping draws more)."""
        return {"dp_clipped": total.clipped}

    def start(self, spill: bool = False, folder: str | None = None) -> ClippedSum:
        return ClippedSum(spill, folder)

    def fold(self, total: ClippedSum, model: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None,
             client: int, weight: float = 1.0) -> None:
        total.add(model, base, self.clip, client, weight)

    def release(self, total: ClippedSum, round_: int, base: dict[str, torch.Tensor] | None):
        """(the new floating entries: base + noised mean, or the mean delta where base is None,
        the round's metrics)."""
        source, std = self.noise(round_), self.std()
        new = total.release_into(std, source, self.m or total.folded, base)
        return new, self.after(total, source)

    def combined(self, total: ClippedSum, round_: int, base: dict[str, torch.Tensor]):
        """(the next model, the update's entries in its order: the floating ones released, the
        others the global model's (released without noise, so not released), the metrics)."""
        new, metrics = self.release(total, round_, base)
        return {n: new[n] if n in new else base[n].clone() for n in total.keys}, metrics

    def __call__(self, deltas: list[dict[str, torch.Tensor]], weights: list[float], client_ids: list[int],
                 round_: int):
        """The rule on a list of float64 deltas: the noised mean delta (float64) and metrics."""
        total = self.start()
        for delta, client in zip(deltas, client_ids):
            self.fold(total, delta, None, client)
        return self.release(total, round_, None)
