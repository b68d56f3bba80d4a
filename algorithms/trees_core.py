"""The arithmetic of histogram gradient boosting as XGBoost's `hist` method does it, split so
that clients compute and the server decides: bin cuts from merged sketches, per-node
gradient/hessian histograms, split choice, leaf weights, and trees written in XGBoost's JSON
model format (the booster then loads, saves and predicts with XGBoost itself).

The formulas are XGBoost's (src/tree/param.h, src/objective/regression_loss.h): gradients in
float32 from the float32 margin, histograms summed in float64, gain G^2/(H+lambda), a split
kept when its loss change exceeds 1e-6 and `min_split_loss` and both children carry at least
`min_child_weight` hessian, leaf weight -G/(H+lambda) times eta, ties to the lower feature.
Cuts follow XGBoost's convention: a feature with at most `max_bin` distinct values is cut at
each of them, so features on a shared grid bin alike centrally and federated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

__all__ = ["OBJECTIVES", "Params", "grad_hess", "local_sketch", "merge_cuts", "bin_rows", "route",
           "histograms", "TreeBuilder", "template", "with_trees", "tree_count"]

OBJECTIVES = ("reg:squarederror", "binary:logistic")
RT_EPS = 1e-6   # XGBoost's kRtEps: a split must gain more than this


@dataclass(frozen=True)
class Params:
    """The booster parameters the federated histogram method honours (XGBoost's names)."""
    objective: str
    max_depth: int = 3
    eta: float = 0.3
    reg_lambda: float = 1.0
    min_child_weight: float = 1.0
    min_split_loss: float = 0.0
    max_bin: int = 256

    def xgboost(self, base_score: float) -> dict:
        return {"objective": self.objective, "tree_method": "hist", "max_depth": self.max_depth,
                "eta": self.eta, "lambda": self.reg_lambda, "min_child_weight": self.min_child_weight,
                "gamma": self.min_split_loss, "max_bin": self.max_bin, "base_score": base_score}


def grad_hess(objective: str, margin: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """XGBoost's first and second derivatives of the loss at the margin, in float32."""
    m, t = margin.astype(np.float32), y.astype(np.float32)
    if objective == "reg:squarederror":
        return m - t, np.ones_like(m)
    p = (np.float32(1) / (np.float32(1) + np.exp(-m))).astype(np.float32)
    return p - t, np.maximum(p * (np.float32(1) - p), np.float32(1e-16))


# ------------------------------------------------------------------ cuts
def local_sketch(x: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Per feature, at most `width` (value, count) pairs summarising the client's column: its
    distinct values with their counts when it has no more than `width`, else the values at
    evenly spaced ranks, each standing for the rows up to it. Padding has count 0."""
    n, f = x.shape
    values, counts = np.zeros((f, width)), np.zeros((f, width))
    for j in range(f):
        u, c = np.unique(x[:, j], return_counts=True)
        if len(u) > width:
            cum = np.cumsum(c)
            pick = np.searchsorted(cum, np.linspace(0, n, width + 1)[1:] - 0.5)
            pick = np.unique(np.minimum(pick, len(u) - 1))
            u, c = u[pick], np.diff(np.concatenate([[0], cum[pick]]))
        values[j, :len(u)], counts[j, :len(u)] = u, c
    return values, counts


def merge_cuts(values: np.ndarray, counts: np.ndarray, max_bin: int) -> list[np.ndarray]:
    """Each feature's cut thresholds (float32, ascending) from the clients' sketches stacked
    on axis 0: the distinct values but the least, then max + |max| + 1e-5, as XGBoost cuts a
    feature of at most `max_bin` values; else `max_bin` weighted quantiles of the merge."""
    cuts = []
    for j in range(values.shape[1]):
        v, c = values[:, j].reshape(-1), counts[:, j].reshape(-1)
        keep = c > 0
        u, inv = np.unique(v[keep].astype(np.float32), return_inverse=True)
        w = np.bincount(inv, weights=c[keep], minlength=len(u))
        if len(u) > max_bin:
            cum = np.cumsum(w)
            pick = np.searchsorted(cum, np.linspace(0, cum[-1], max_bin + 1)[1:-1])
            u = np.unique(np.concatenate([u[:1], u[np.minimum(pick + 1, len(u) - 1)], u[-1:]]))
        top = np.float32(u[-1] + abs(u[-1]) + 1e-5) if len(u) else np.float32(1e-5)
        cuts.append(np.append(u[1:], top).astype(np.float32))
    return cuts


def bin_rows(x: np.ndarray, cuts: list[np.ndarray]) -> np.ndarray:
    """Each value's bin: the number of cuts at or below it (left of cut k: bins <= k)."""
    xf = x.astype(np.float32)
    return np.stack([np.searchsorted(c, xf[:, j], side="right") for j, c in enumerate(cuts)], axis=1)


def route(bins: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Each row's node in a partial tree: rows (feature, bin, left, right), -1 where not split."""
    at = np.zeros(len(bins), dtype=np.int64)
    while True:
        feat = nodes[at, 0].astype(np.int64)
        split = feat >= 0
        if not split.any():
            return at
        rows = np.nonzero(split)[0]
        go_left = bins[rows, feat[split]] <= nodes[at[rows], 1]
        at[rows] = np.where(go_left, nodes[at[rows], 2], nodes[at[rows], 3]).astype(np.int64)


def histograms(bins: np.ndarray, g: np.ndarray, h: np.ndarray, at: np.ndarray, frontier: list[int],
               n_bins: int) -> np.ndarray:
    """float64 [frontier, features, n_bins, 2]: the sums of g and h of each node's rows per bin."""
    out = np.zeros((len(frontier), bins.shape[1], n_bins, 2))
    for i, node in enumerate(frontier):
        rows = at == node
        for j in range(bins.shape[1]):
            out[i, j, :, 0] = np.bincount(bins[rows, j], weights=g[rows].astype(np.float64), minlength=n_bins)
            out[i, j, :, 1] = np.bincount(bins[rows, j], weights=h[rows].astype(np.float64), minlength=n_bins)
    return out


# ------------------------------------------------------------------ one tree
@dataclass
class _Node:
    G: float
    H: float
    depth: int
    parent: int
    feature: int = -1
    bin: int = -1
    threshold: float = 0.0
    left: int = -1
    right: int = -1
    loss_chg: float = 0.0


@dataclass
class TreeBuilder:
    """A tree grown depth-wise, one level per round of histograms: `frontier` are the nodes
    whose histograms the next round asks for; `grow` picks their splits."""
    params: Params
    cuts: list[np.ndarray]
    nodes: list[_Node] = field(default_factory=list)
    frontier: list[int] = field(default_factory=lambda: [0])

    def gain(self, G, H):
        return G * G / (H + self.params.reg_lambda)

    def grow(self, hist: np.ndarray) -> None:
        """Choose each frontier node's split from its summed histogram; its children are the
        next frontier, unless they are at `max_depth`."""
        p, nxt = self.params, []
        for i, node_id in enumerate(self.frontier):
            hh = hist[i]
            if not self.nodes:   # the root's sums: any feature's bins together
                self.nodes.append(_Node(float(hh[0, :, 0].sum()), float(hh[0, :, 1].sum()), 0, -1))
            node = self.nodes[node_id]
            best = self._best_split(node, hh)
            if best is None:
                continue
            loss, j, b, GL, HL = best
            node.feature, node.bin, node.threshold, node.loss_chg = j, b, float(self.cuts[j][b]), loss
            for G, H in ((GL, HL), (node.G - GL, node.H - HL)):
                self.nodes.append(_Node(G, H, node.depth + 1, node_id))
            node.left, node.right = len(self.nodes) - 2, len(self.nodes) - 1
            if node.depth + 1 < p.max_depth:
                nxt += [node.left, node.right]
        self.frontier = nxt

    def _best_split(self, node: _Node, hh: np.ndarray):
        p = self.params
        parent = self.gain(node.G, node.H)
        best = None
        for j, c in enumerate(self.cuts):
            cum = np.cumsum(hh[j, :len(c)], axis=0)[:-1]     # left sums for splits after bins 0..k-2
            GL, HL = cum[:, 0], cum[:, 1]
            GR, HR = node.G - GL, node.H - HL
            ok = (HL >= p.min_child_weight) & (HR >= p.min_child_weight)
            loss = np.where(ok, self.gain(GL, HL) + self.gain(GR, HR) - parent, -np.inf)
            if not len(loss):
                continue
            b = int(np.argmax(loss))
            if loss[b] > RT_EPS and loss[b] >= p.min_split_loss and (best is None or loss[b] > best[0]):
                best = (float(loss[b]), j, b, float(GL[b]), float(HL[b]))
        return best

    @property
    def done(self) -> bool:
        return not self.frontier

    def wire(self) -> np.ndarray:
        """The partial tree clients route rows through: float64 rows (feature, bin, left, right)."""
        if not self.nodes:
            return np.full((1, 4), -1.0)
        return np.array([[n.feature, n.bin, n.left, n.right] for n in self.nodes], dtype=np.float64)

    def xgboost_tree(self, tree_id: int, num_feature: int) -> dict:
        """The tree as one entry of XGBoost's JSON `trees` list."""
        p, ns = self.params, self.nodes
        leaf = [n.feature < 0 for n in ns]
        weight = [np.float32(-n.G / (n.H + p.reg_lambda)) * (np.float32(p.eta) if lf else 1)
                  for n, lf in zip(ns, leaf)]   # XGBoost keeps a leaf's weight scaled by eta
        return {
            "base_weights": [float(w) for w in weight], "categories": [], "categories_nodes": [],
            "categories_segments": [], "categories_sizes": [], "default_left": [0] * len(ns), "id": tree_id,
            "left_children": [n.left for n in ns], "right_children": [n.right for n in ns],
            "loss_changes": [float(np.float32(n.loss_chg)) for n in ns],
            "parents": [2147483647 if n.parent < 0 else n.parent for n in ns],
            "split_conditions": [float(w) if lf else float(n.threshold)
                                 for n, w, lf in zip(ns, weight, leaf)],
            "split_indices": [max(n.feature, 0) for n in ns], "split_type": [0] * len(ns),
            "sum_hessian": [float(np.float32(n.H)) for n in ns],
            "tree_param": {"num_deleted": "0", "num_feature": str(num_feature), "num_nodes": str(len(ns)),
                           "size_leaf_vector": "1"}}


# ------------------------------------------------------------------ XGBoost's model format
def template(params: dict, num_feature: int) -> dict:
    """An empty booster of these parameters in XGBoost's JSON format, as XGBoost writes it."""
    import xgboost as xgb
    d = xgb.DMatrix(np.zeros((2, num_feature)), label=np.array([0.0, 1.0]))
    return json.loads(bytes(xgb.train({**params, "nthread": 1}, d, 0).save_raw("json")))


def tree_count(model: dict) -> int:
    return len(model["learner"]["gradient_booster"]["model"]["trees"])


def with_trees(model: dict, trees: list[dict]) -> dict:
    """`model` with `trees` appended (renumbered), one tree per boosting iteration."""
    out = json.loads(json.dumps(model))
    gb = out["learner"]["gradient_booster"]["model"]
    for t in trees:
        t = {**t, "id": len(gb["trees"])}
        gb["trees"].append(t)
        gb["tree_info"].append(0)
        gb["iteration_indptr"].append(len(gb["trees"]))
    gb["gbtree_model_param"]["num_trees"] = str(len(gb["trees"]))
    return out
