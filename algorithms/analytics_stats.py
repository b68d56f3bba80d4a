"""Federated statistics as sums: what a client sends, how the server adds it up, and what the
sums say (count, sum, mean, variance, min/max, histograms, quantiles).

A client's reply is a vector of integers (and, for min/max, a vector of floats). Counts and
histogram bins are integers already. Sums of values and of squares are made exact: each value
x (clipped to its column's bounds) becomes the integer D = rint(x 2^F) - C, C = rint(c 2^F)
for the bounds' midpoint c, so that D 2^-F is x shifted by an exactly known amount; the
integers D and D^2 are added exactly (Python integers) and travel as two's-complement limbs of
32 bits. The server adds the clients' integers exactly and rounds each statistic once, so
count, sum, mean and variance equal the exact statistic of the union rounded to float64,
whatever the partition, for every value that is a multiple of 2^-F (all float64 values of
magnitude at least 2^(52-F)); any other value is first rounded to the nearest multiple of 2^-F.

Quantiles refine a histogram over rounds: round 1 counts `quantile_bins` equal bins over the
bounds; each later round splits, for each (column, group, q), the bin holding the target
order statistic x_(k), k = max(1, ceil(q n)) (numpy's `inverted_cdf`), into as many again.
The reported value is the final bin's midpoint: within half its width of x_(k).

With DP, every block of sums a round releases gets Gaussian noise: a block whose entries one
record changes by at most Delta in L2 gets sigma = z sqrt(J) Delta, J the round's number of
blocks, which is the Gaussian mechanism with noise multiplier z on the sums rescaled to
sensitivity 1 (`block_sigmas`); the accountant composes it over the rounds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["STATISTICS", "Column", "Plan", "Block", "Target", "LIMB_BITS", "ROW_BITS", "encode", "decode",
           "base_blocks", "refine_blocks", "local_sums", "local_extremes", "combine", "block_sigmas",
           "released", "results", "locate", "next_targets", "first_targets"]

STATISTICS = ("count", "sum", "mean", "variance", "min", "max", "histogram", "quantiles")
LIMB_BITS = 32          # bits of each limb of an exact sum
ROW_BITS = 40           # the union may hold up to 2^40 rows: room in every exact sum


@dataclass(frozen=True)
class Column:
    """One column asked for: its position in a client's rows, bounds and histogram edges."""

    name: str
    index: int
    lo: float
    hi: float
    edges: tuple[float, ...]

    def center(self, bits: int) -> int:
        """C = rint(c 2^F) for the bounds' midpoint c: the exact shift of the integers D."""
        return int(np.rint(np.ldexp((self.lo + self.hi) / 2.0, bits)))

    def half_range(self, bits: int) -> float:
        """h: the most |D 2^-F| can be for x within the bounds (each record's share of a sum):
        the bounds' half-width around C 2^-F, plus half a step for the rounding to 2^-F."""
        c = self.center(bits) / 2.0 ** bits
        return max(self.hi - c, c - self.lo) + 2.0 ** (-bits - 1)

    def limbs(self, bits: int, power: int) -> int:
        """Limbs of the exact sum of D^power: room for 2^ROW_BITS rows and a sign."""
        top = max(abs(self.lo), abs(self.hi)) * 2.0 + 1.0
        magnitude = power * (math.frexp(top)[1] + bits)
        return -(-(ROW_BITS + magnitude + 1) // LIMB_BITS)


@dataclass(frozen=True)
class Plan:
    """What a course computes: the same on the server and on every client (from the config)."""

    statistics: frozenset[str]
    columns: tuple[Column, ...]
    groups: tuple[str, ...]          # ("all",) when not grouped
    quantiles: tuple[float, ...]
    quantile_bins: int
    quantile_rounds: int
    fraction_bits: int

    @property
    def rounds(self) -> int:
        return self.quantile_rounds if "quantiles" in self.statistics else 1

    @property
    def sums(self) -> bool:
        return bool(self.statistics & {"sum", "mean", "variance"})

    @property
    def squares(self) -> bool:
        return "variance" in self.statistics

    @property
    def extremes(self) -> bool:
        return bool(self.statistics & {"min", "max"})

    def quantile_edges(self, col: Column) -> np.ndarray:
        return np.linspace(col.lo, col.hi, self.quantile_bins + 1)


@dataclass(frozen=True)
class Block:
    """A run of the reply vector: one kind of sum for one column, over all groups."""

    kind: str            # count, sum, square, histogram, quantile_histogram, refine
    column: int | None   # index into plan.columns (None: count)
    length: int          # integers in the vector
    per_group: int       # values per group (limbs for sums, bins for histograms)
    sensitivity: float   # L2 change of the block's values when one record is added or removed


@dataclass(frozen=True)
class Target:
    """A quantile being refined: the interval [a, b] (b included when `closed`) holding x_(k),
    and how many of the group's records lie below a."""

    column: int
    group: int
    q: float
    a: float
    b: float
    closed: bool
    below: float


def base_blocks(plan: Plan) -> list[Block]:
    """Round 1's reply: counts, then per column its exact sums and histograms."""
    g, f = len(plan.groups), plan.fraction_bits
    blocks = [Block("count", None, g, 1, 1.0)]
    for i, col in enumerate(plan.columns):
        h = col.half_range(f)
        if plan.sums:
            n = col.limbs(f, 1)
            blocks.append(Block("sum", i, g * n, n, h))
        if plan.squares:
            n = col.limbs(f, 2)
            blocks.append(Block("square", i, g * n, n, h * h))
        if "histogram" in plan.statistics:
            n = len(col.edges) - 1
            blocks.append(Block("histogram", i, g * n, n, 1.0))
        if "quantiles" in plan.statistics:
            blocks.append(Block("quantile_histogram", i, g * plan.quantile_bins, plan.quantile_bins, 1.0))
    return blocks


def refine_blocks(plan: Plan) -> list[Block]:
    """A refinement round's reply: per column, the sub-bin counts of every (group, q) target;
    a record falls in at most one sub-bin per q, so its L2 change is sqrt(#quantiles)."""
    per = len(plan.quantiles) * plan.quantile_bins
    return [Block("refine", i, len(plan.groups) * per, per, math.sqrt(len(plan.quantiles)))
            for i in range(len(plan.columns))]


# ------------------------------------------------------------------ exact integers as limbs
def encode(value: int, limbs: int) -> list[int]:
    """`value` as `limbs` little-endian 32-bit limbs of its two's complement."""
    v = value % (1 << (LIMB_BITS * limbs))
    mask = (1 << LIMB_BITS) - 1
    return [(v >> (LIMB_BITS * i)) & mask for i in range(limbs)]


def decode(limbs: Any, count: int | None = None) -> int:
    """The signed integer of a run of limbs (each in [0, 2^32), or a sum of such runs whose
    limbs exceed it: the carries are taken as they come)."""
    limbs = [int(v) for v in limbs]
    width = LIMB_BITS * len(limbs)
    v = sum(limb << (LIMB_BITS * i) for i, limb in enumerate(limbs)) % (1 << width)
    return v - (1 << width) if v >> (width - 1) else v


# ------------------------------------------------------------------ the client's half
def _scaled(values: np.ndarray, col: Column, bits: int) -> list[int]:
    """D = rint(x 2^F) - C for each clipped value, as exact Python integers."""
    center = col.center(bits)
    return [int(v) - center for v in np.rint(np.ldexp(values, bits))]


def local_sums(plan: Plan, rows: np.ndarray, groups: np.ndarray, blocks: list[Block],
               targets: list[Target] | None = None) -> list[int]:
    """The integer reply vector for `blocks` over a client's `rows` (n x columns, float64) and
    their group indices."""
    bad = [c.name for c in plan.columns if not np.isfinite(rows[:, c.index]).all()]
    if bad:
        raise ValueError(f"analytics: this client's column '{bad[0]}' holds a missing or non-finite value")
    out: list[int] = []
    masks = [groups == g for g in range(len(plan.groups))]
    for block in blocks:
        if block.kind == "count":
            out.extend(int(m.sum()) for m in masks)
            continue
        col = plan.columns[block.column]
        values = np.clip(rows[:, col.index], col.lo, col.hi)
        for g, mask in enumerate(masks):
            mine = values[mask]
            if block.kind in ("sum", "square"):
                power = 1 if block.kind == "sum" else 2
                out.extend(encode(sum(d ** power for d in _scaled(mine, col, plan.fraction_bits)),
                                  block.per_group))
            elif block.kind == "histogram":
                out.extend(int(c) for c in np.histogram(mine, bins=np.asarray(col.edges))[0])
            elif block.kind == "quantile_histogram":
                out.extend(int(c) for c in np.histogram(mine, bins=plan.quantile_edges(col))[0])
            else:   # refine: this column's targets of group g, in the order of plan.quantiles
                for t in targets or []:
                    if t.column == block.column and t.group == g:
                        out.extend(_sub_counts(mine, t, plan.quantile_bins))
    return out


def _sub_counts(values: np.ndarray, t: Target, bins: int) -> list[int]:
    inside = (values >= t.a) & ((values < t.b) | (t.closed & (values == t.b)))
    return [int(c) for c in np.histogram(values[inside], bins=np.linspace(t.a, t.b, bins + 1))[0]]


def local_extremes(plan: Plan, rows: np.ndarray, groups: np.ndarray) -> list[float]:
    """(min, max) of each column's clipped values per group; an empty group sends (hi, lo),
    which no other client's values can lose to."""
    out: list[float] = []
    for col in plan.columns:
        values = np.clip(rows[:, col.index], col.lo, col.hi)
        for g in range(len(plan.groups)):
            mine = values[groups == g]
            out.extend((float(mine.min()), float(mine.max())) if mine.size else (col.hi, col.lo))
    return out


# ------------------------------------------------------------------ the server's half
def combine(blocks: list[Block], replies: list[np.ndarray]) -> list[list[int]]:
    """The exact sums of the clients' replies, block by block, value by value (limbs decoded)."""
    total = np.zeros(sum(b.length for b in blocks), dtype=object)
    for r in replies:
        total = total + np.asarray(r, dtype=np.int64).astype(object)
    out, pos = [], 0
    for b in blocks:
        run = list(total[pos:pos + b.length])
        pos += b.length
        if b.kind in ("sum", "square"):
            out.append([decode(run[i:i + b.per_group]) for i in range(0, b.length, b.per_group)])
        else:
            out.append([int(v) for v in run])
    return out


def block_sigmas(blocks: list[Block], multiplier: float) -> list[float]:
    """sigma of each block's noise: z sqrt(J) Delta_block (J blocks in the round)."""
    return [multiplier * math.sqrt(len(blocks)) * b.sensitivity for b in blocks]


def _value(block: Block, exact: int, plan: Plan) -> Fraction:
    """An exact sum in the data's units (D 2^-F, D^2 2^-2F; counts as they are)."""
    if block.kind == "sum":
        return Fraction(exact, 1 << plan.fraction_bits)
    if block.kind == "square":
        return Fraction(exact, 1 << (2 * plan.fraction_bits))
    return Fraction(exact)


def released(plan: Plan, blocks: list[Block], sums: list[list[int]], noise: list[np.ndarray] | None
             ) -> list[list[Any]]:
    """Each block's values in the data's units: exact Fractions, or floats with their noise."""
    out = []
    for b, run, extra in zip(blocks, sums, noise or [None] * len(blocks)):
        values: list[Any] = [_value(b, v, plan) for v in run]
        if extra is not None:
            values = [float(v) + float(e) for v, e in zip(values, extra)]
        out.append(values)
    return out


def results(plan: Plan, blocks: list[Block], values: list[list[Any]], extremes: np.ndarray | None,
            targets: list[Target]) -> dict[str, dict[str, dict[str, Any]]]:
    """statistics.json's body: {column: {group: {statistic: value}}}, each value rounded once."""
    by_kind = {(b.kind, b.column): v for b, v in zip(blocks, values)}
    counts = by_kind[("count", None)]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for i, col in enumerate(plan.columns):
        bits = plan.fraction_bits
        c = Fraction(col.center(bits), 1 << bits)
        per_col: dict[str, dict[str, Any]] = {}
        for g, group in enumerate(plan.groups):
            n = counts[g]
            exact = isinstance(n, Fraction)
            stats: dict[str, Any] = {}
            if "count" in plan.statistics:
                stats["count"] = int(n) if exact else float(n)
            usable = n > 0 if exact else True
            nn = n if exact else max(float(n), 1.0)
            if plan.sums:
                s1 = by_kind[("sum", i)][g]
                total = s1 + n * c
                if "sum" in plan.statistics:
                    stats["sum"] = float(total)
                if "mean" in plan.statistics:
                    stats["mean"] = float(total / nn) if usable else None
                if plan.squares:
                    s2 = by_kind[("square", i)][g]
                    var = (s2 - s1 * s1 / nn) / nn if usable else None
                    stats["variance"] = (float(var) if exact else max(float(var), 0.0)) if usable else None
            if extremes is not None and n:
                lo, hi = extremes[(i * len(plan.groups) + g) * 2: (i * len(plan.groups) + g) * 2 + 2]
                if "min" in plan.statistics:
                    stats["min"] = float(lo)
                if "max" in plan.statistics:
                    stats["max"] = float(hi)
            elif extremes is not None:
                stats.update({k: None for k in ("min", "max") if k in plan.statistics})
            if "histogram" in plan.statistics:
                run = by_kind[("histogram", i)]
                k = len(col.edges) - 1
                stats["histogram"] = {"edges": list(col.edges),
                                      "counts": [int(v) if exact else float(v) for v in run[g * k:(g + 1) * k]]}
            if "quantiles" in plan.statistics:
                stats["quantiles"] = {
                    repr(t.q): ({"value": (t.a + t.b) / 2.0, "interval": [t.a, t.b]} if (n > 0 if exact else True)
                                else None)
                    for t in targets if t.column == i and t.group == g}
            per_col[group] = stats
        out[col.name] = per_col
    return out


# ------------------------------------------------------------------ quantile refinement
def locate(edges: np.ndarray, counts: list[Any], below: float, k: float, closed: bool
           ) -> tuple[float, float, bool, float]:
    """The bin of `edges` (with `counts`, `below` records under edges[0]) holding the k-th
    smallest record: (a, b, b included, records below a). Noisy counts that never reach k
    give the last bin; a k already reached below gives the first."""
    running = below
    last = len(counts) - 1
    for j, c in enumerate(counts):
        if running + float(c) >= k or j == last:
            return float(edges[j]), float(edges[j + 1]), bool(closed and j == last), running
        running += float(c)
    raise ValueError("no bins")


def _rank(q: float, n: Any) -> float:
    """k = max(1, ceil(q n)) of numpy's `inverted_cdf` (n rounded where it is noisy)."""
    n = int(n) if isinstance(n, Fraction) else max(int(round(float(n))), 1)
    return max(1, math.ceil(q * n))


def first_targets(plan: Plan, blocks: list[Block], values: list[list[Any]]) -> list[Target]:
    """From round 1's quantile histograms, the bin holding each target order statistic."""
    by_kind = {(b.kind, b.column): v for b, v in zip(blocks, values)}
    counts = by_kind[("count", None)]
    m = plan.quantile_bins
    out = []
    for i, col in enumerate(plan.columns):
        run = by_kind[("quantile_histogram", i)]
        edges = plan.quantile_edges(col)
        for g in range(len(plan.groups)):
            for q in plan.quantiles:
                a, b, closed, below = locate(edges, run[g * m:(g + 1) * m], 0.0, _rank(q, counts[g]), True)
                out.append(Target(i, g, q, a, b, closed, below))
    return out


def next_targets(plan: Plan, targets: list[Target], values: list[list[Any]], counts: list[Any]
                 ) -> list[Target]:
    """From a refinement round's sub-bin counts, each target's narrower interval."""
    m = plan.quantile_bins
    seen: dict[tuple[int, int], int] = {}
    out = []
    for t in targets:
        pos = seen.get((t.column, t.group), 0)
        seen[(t.column, t.group)] = pos + 1
        run = values[t.column][(t.group * len(plan.quantiles) + pos) * m:
                               (t.group * len(plan.quantiles) + pos + 1) * m]
        a, b, closed, below = locate(np.linspace(t.a, t.b, m + 1), run, t.below,
                                     _rank(t.q, counts[t.group]), t.closed)
        out.append(Target(t.column, t.group, t.q, a, b, closed, below))
    return out
