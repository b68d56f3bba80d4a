"""The matrix mechanism behind DP-FTRL: a factorization A = B C of the prefix-sum matrix.

A is the T x T lower-triangular matrix of ones, so A G holds the prefix sums of the rounds'
(clipped, summed) updates G. The server releases B (C G + Z) = A G + B Z with Z Gaussian:
each round t adds the t-th row of C G + Z to its state and moves the model by the t-th
increment of the noise B Z. With C lower-triangular the release is streaming and, for
adaptively chosen G, as private as the one-shot Gaussian mechanism on C G (Denisov, McMahan,
Rush, Smith, Thakurta, NeurIPS 2022).

- **Tree** (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, ICML 2021): row t of C is the
  dyadic node [t - lowbit(t) + 1, t], the one node each round completes; the prefix t gets
  the noise of the nodes of t's binary decomposition (`tree_nodes`), so at most
  ceil(log2 T) + 1 node noises are alive at once (`TreeNoise`).
- **Banded** (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, NeurIPS 2023): C
  lower-triangular with `bands` non-zero diagonals, unit column norms, minimizing the
  prefix sums' total squared error ||A C^-1||_F^2 (`banded_matrix`); the noise increment of
  round t is w_t of C w = Z, which needs the last bands - 1 of them (`BandedNoise`).

`sensitivity(C, k, b)` bounds max ||C u|| over a client's contributions u (one row of G per
participation, each of norm <= 1) when a client takes part at most k times, at least b
rounds apart; docs/algorithms/dp_ftrl.md maps the papers' equations to this code.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

__all__ = ["lowbit", "tree_nodes", "tree_matrix", "banded_sqrt", "banded_matrix", "sensitivity",
           "TreeNoise", "BandedNoise"]

Draw = Callable[[], torch.Tensor]   # one N(0, I) vector, float64, for the round's new row of Z


def lowbit(t: int) -> int:
    """The largest power of two dividing t >= 1."""
    return t & -t


def tree_nodes(t: int) -> list[tuple[int, int]]:
    """The dyadic nodes (first round, last round) whose sum is the prefix [1, t], largest
    first: t's binary decomposition; node (s, e) is row e of the tree's C."""
    nodes, end = [], t
    while end > 0:
        size = lowbit(end)
        nodes.append((end - size + 1, end))
        end -= size
    return nodes[::-1]


def tree_matrix(T: int) -> np.ndarray:
    """The tree's C, T x T: row t is 1 on the node [t - lowbit(t) + 1, t]."""
    C = np.zeros((T, T))
    for t in range(1, T + 1):
        C[t - 1, t - lowbit(t):t] = 1.0
    return C


def banded_sqrt(T: int, bands: int) -> np.ndarray:
    """The square root of A (Toeplitz, c_k = binom(2k, k) / 4^k) cut to `bands` diagonals,
    columns scaled to unit norm: the starting point of `banded_matrix`."""
    c = np.ones(bands)
    for k in range(1, bands):
        c[k] = c[k - 1] * (2 * k - 1) / (2 * k)
    C = sum(np.diag(np.full(T - k, c[k]), -k) for k in range(min(bands, T)))
    return C / np.linalg.norm(C, axis=0)


def banded_matrix(T: int, bands: int, iters: int = 100) -> np.ndarray:
    """A `bands`-banded lower-triangular C with unit column norms minimizing ||A C^-1||_F^2,
    by L-BFGS over the band's entries from `banded_sqrt` (the columns are normalized
    inside the loss, so the constraint always holds)."""
    bands = max(1, min(bands, T))
    start = torch.tensor(banded_sqrt(T, bands))
    mask = torch.zeros(T, T, dtype=torch.bool)
    for k in range(bands):
        mask |= torch.diag(torch.ones(T - k, dtype=torch.bool), -k)
    free = start[mask].clone().requires_grad_(True)
    A = torch.tril(torch.ones(T, T, dtype=torch.float64))
    eye = torch.eye(T, dtype=torch.float64)

    def build(values: torch.Tensor) -> torch.Tensor:
        M = torch.zeros(T, T, dtype=torch.float64).masked_scatter(mask, values)
        return M / M.norm(dim=0)

    def loss() -> torch.Tensor:
        inv = torch.linalg.solve_triangular(build(free), eye, upper=False)
        return (A @ inv).square().sum()

    if bands > 1:
        opt = torch.optim.LBFGS([free], max_iter=iters, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            value = loss()
            value.backward()
            return value
        with torch.no_grad():
            before = float(loss())
        opt.step(closure)
        with torch.no_grad():
            after = float(loss())
        if not after <= before:   # never worse than the start (nor NaN)
            free = start[mask]
    with torch.no_grad():
        return build(free.detach()).numpy()


def _best_picks(values: np.ndarray, k: int, b: int, at: np.ndarray) -> np.ndarray:
    """best[c, i]: the largest sum of at most c entries of row i of `values` (r x n) among
    columns 0..at[i] (none where at[i] < 0), any two at least b columns apart; (k + 1) x r.
    A dynamic program over the columns that keeps two r x n layers, not k + 1."""
    r, n = values.shape
    rows = np.arange(r)
    out = np.zeros((k + 1, r))
    prev = np.zeros((r, n))          # layer c - 1: best with at most c - 1 picks up to column p
    for c in range(1, k + 1):
        cur = np.zeros((r, n))
        for p in range(n):
            take = values[:, p] + (prev[:, p - b] if p - b >= 0 else 0.0)
            cur[:, p] = np.maximum(np.maximum(take, prev[:, p]), cur[:, p - 1] if p > 0 else 0.0)
        valid = at >= 0
        out[c, valid] = cur[rows[valid], at[valid]]
        prev = cur
    return out


def sensitivity(C: np.ndarray, k: int, b: int) -> float:
    """An upper bound on max ||sum_{i in P} C[:, i] u_i|| over participations P (at most k
    rounds, any two at least b apart) and contributions ||u_i|| <= 1: with X = |C^T C|,
    sqrt(max_P sum_{i in P} R_i), R_i = max_{P contains i} sum_{j in P} X_ij. Exact for one
    participation (max_i ||C[:, i]||), for every round (k = T, b = 1, C >= 0: ||C 1||) and
    for a banded C whose band is at most b wide (sqrt(k) max_i ||C[:, i]||)."""
    T = C.shape[1]
    k = max(1, min(k, T))
    X = np.abs(C.T @ C)
    widest = max(max((i - j for i, j in zip(*np.nonzero(C))), default=0) + 1, 1)
    if k == 1:
        return float(np.sqrt(X.diagonal().max()))
    if widest <= b:   # columns of different participations are orthogonal: the best diagonal picks
        return float(np.sqrt(_best_picks(X.diagonal()[None, :], k, b, np.array([T - 1]))[k, 0]))
    # R_i: X_ii plus the best k - 1 picks split between columns <= i - b and >= i + b
    idx = np.arange(T)
    left = _best_picks(X, k - 1, b, idx - b)
    right = _best_picks(X[:, ::-1], k - 1, b, (T - 1 - idx) - b)
    R = X.diagonal() + np.max([left[c] + right[k - 1 - c] for c in range(k)], axis=0)
    total = _best_picks(R[None, :], k, b, np.array([T - 1]))[k, 0]
    return float(np.sqrt(total))


class TreeNoise:
    """The tree's noise increments: round t draws node [t - lowbit(t) + 1, t]'s noise and the
    model moves by the prefix noise of t minus that of t - 1 (the nodes t - 1 used that t
    does not use are dropped, never to be used again)."""

    def __init__(self) -> None:
        self.live: dict[tuple[int, int], torch.Tensor] = {}

    def increment(self, t: int, draw: Draw) -> torch.Tensor:
        new = (t - lowbit(t) + 1, t)
        z = draw()
        gone = [node for node in tree_nodes(t - 1) if node not in tree_nodes(t)]
        out = z.clone()
        for node in gone:
            out -= self.live.pop(node)
        self.live[new] = z
        return out

    def state(self) -> dict[str, Any]:
        return {"nodes": [[s, e] for s, e in self.live], "noise": list(self.live.values())}

    def restore(self, state: dict[str, Any]) -> None:
        self.live = {(int(s), int(e)): z for (s, e), z in zip(state["nodes"], state["noise"])}


class BandedNoise:
    """The banded factorization's noise increments w_t = (z_t - sum_{j<t} C[t, j] w_j) / C[t, t],
    keeping the last bands - 1 of them."""

    def __init__(self, C: np.ndarray, bands: int) -> None:
        self.C, self.bands = C, bands
        self.recent: list[torch.Tensor] = []   # w_{t-bands+1} .. w_{t-1}

    def increment(self, t: int, draw: Draw) -> torch.Tensor:
        w = draw()
        for back, prev in enumerate(reversed(self.recent), start=1):
            w = w - float(self.C[t - 1, t - 1 - back]) * prev
        w = w / float(self.C[t - 1, t - 1])
        self.recent = (self.recent + [w])[-(self.bands - 1):] if self.bands > 1 else []
        return w

    def state(self) -> dict[str, Any]:
        return {"recent": list(self.recent)}

    def restore(self, state: dict[str, Any]) -> None:
        self.recent = list(state["recent"])
