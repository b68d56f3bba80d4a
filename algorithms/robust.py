"""Byzantine-robust aggregation rules (`aggregator.robust_rule`).

Each rule maps the clients' update deltas (received model minus the global
model) to one delta, and composes with any FedAvg-style aggregator through
`replace_combination`:

- `krum` / `multi_krum` (Blanchard et al., 2017): score each update by the
  summed squared distances to its n - f - 2 nearest others; keep the m best
  (`krum_m`, 1 for Krum, n - f by default for multi-Krum) and average them;
- `median` (Yin et al., 2018): the coordinate-wise median;
- `trimmed_mean` (Yin et al., 2018): per coordinate, drop the k = floor(trim_ratio * n)
  largest and smallest values and average the rest;
- `norm_bound` (Sun et al., 2019): scale each delta down to L2 norm at most
  `norm_bound`, then take the sample-weighted mean;
- `centered_clip` (Karimireddy, He, Jaggi, 2021): starting from a center v, L =
  `cc_iters` times v <- v + sum_i p_i (x_i - v) min(1, tau / ||x_i - v||), tau =
  `cc_tau`, p_i the weights. However far a client's delta lies from the center, its
  term in each iteration has norm at most p_i tau. The center (`cc_center`) is the
  previous round's combined delta (the paper's), which carries a client's earlier
  pushes into every later round, or this round's coordinate-wise median, which
  carries nothing over (docs/algorithms/centered_clip.md).

Algorithms whose aggregation uses more than the mean model (SCAFFOLD's
control variates, FedDyn's server state, single-update async mixing) are
refused at configuration time.
"""
from __future__ import annotations

import math

import torch

from fedcore.kernel import registry
from fedcore.algorithms.combine import BandedRule, Columns, replace_combination
from fedcore.kernel.config import declare, lives_elsewhere, non_negative, positive, resolver, validator
from fedcore.kernel.contract import Aggregator
from fedcore.kernel.errors import ConfigError

__all__ = ["RULES", "INCOMPATIBLE", "squared_distances", "krum_scores", "krum_select", "coordinate_median",
           "trimmed_mean", "clip_to_norm", "centered_clip", "median_reach", "make_rule", "install"]

RULES = ("none", "krum", "multi_krum", "median", "trimmed_mean", "norm_bound", "centered_clip")
INCOMPATIBLE = {
    "scaffold": "its control variates are averaged alongside the model",
    "feddyn": "its server state is built from every client's model",
    "fedasync": "it mixes one update at a time, there is nothing to vote on",
    "fedbuff": "its updates are deltas from each client's own starting model, not models",
}

declare("aggregator.robust_rule", str, "none", "how updates are combined: none (the algorithm's "
        "weighted mean), krum, multi_krum, median, trimmed_mean, norm_bound, centered_clip",
        choices=RULES)
declare("aggregator.byzantine_num", int, 0, "krum/multi_krum: assumed number f of Byzantine updates "
        "per aggregation", check=non_negative)
declare("aggregator.krum_m", int, None, "krum/multi_krum: how many best-scored updates are averaged "
        "(krum: 1, multi_krum: n - f)", check=positive)
declare("aggregator.trim_ratio", float, 0.1, "trimmed_mean: fraction trimmed at each end per "
        "coordinate", check=lambda v: None if 0 <= v < 0.5 else "must be in [0, 0.5)")
declare("aggregator.norm_bound", float, None, "norm_bound: largest L2 norm of an update delta",
        check=positive)
declare("aggregator.cc_tau", float, None, "centered_clip: radius tau to which each delta's distance "
        "from the center (aggregator.cc_center) is clipped", check=positive)
declare("aggregator.cc_center", str, "previous", "centered_clip: where the iterations start: previous "
        "(the last round's combined delta, the paper's rule: one client's push there is carried into "
        "every later round) or median (this round's coordinate-wise median: one client moves a round's "
        "result by a bounded amount and nothing carries over; recommended facing untrusted clients)",
        choices=("previous", "median"))
declare("aggregator.cc_iters", int, 1, "centered_clip: clipping iterations L per aggregation",
        check=positive)
declare("topology.edge_robust_rule", str, "none", "hierarchical courses (topology.edges): the rule "
        "each edge combines its clients' models with, one of aggregator.robust_rule's, with the "
        "same aggregator.* parameters (aggregator.robust_rule is the cloud's rule)", choices=RULES)
for _rule in RULES:
    if _rule != "none":
        lives_elsewhere("algorithm.name", _rule, f"aggregator.robust_rule={_rule}")


# rules whose papers average the chosen or clipped updates alike, (1/m) or (1/n)
UNIFORM_RULES = ("krum", "multi_krum", "centered_clip")


@resolver
def _weighting(values: dict) -> None:
    """`aggregator.weighting: auto`: the papers' uniform mean under Multi-Krum (Blanchard et al.)
    and centered clipping (Karimireddy et al.), where the algorithm's aggregation uses the
    contract's weights; FedAvg's sample weights otherwise."""
    if values["aggregator.weighting"] != "auto":
        return
    uniform = values["aggregator.robust_rule"] in UNIFORM_RULES
    if uniform and values["algorithm.name"] in registry.algorithms.names():
        aggregator = registry.algorithms.get(values["algorithm.name"]).aggregator
        uniform = aggregator.weights is Aggregator.weights   # else its own weighting rules
    values["aggregator.weighting"] = "uniform" if uniform else "num_samples"


def _per_aggregation(cfg) -> tuple[int, str]:
    """How many updates an aggregation may have, and how to say it."""
    from fedcore.kernel.schema import clients_per_round
    if cfg["course"] == "async":
        # goal_achieved aggregates exactly the goal; time_up as few as the goal
        from fedcore.handlers.asyn import resolve_strategy
        return resolve_strategy(cfg).goal, "an aggregation may have only"
    return clients_per_round(cfg), "a round has at most"


@validator
def _check_robust(cfg) -> None:
    rule = cfg["aggregator.robust_rule"]
    if rule == "none":
        return
    why = INCOMPATIBLE.get(cfg["algorithm.name"])
    if why:
        raise ConfigError(f"aggregator.robust_rule: {rule} cannot be combined with algorithm.name "
                          f"{cfg['algorithm.name']} ({why}); use robust_rule=none or a FedAvg-style "
                          "algorithm")
    if rule in ("krum", "multi_krum"):
        n, where = _per_aggregation(cfg)
        f = cfg["aggregator.byzantine_num"]
        if n <= f + 2:
            raise ConfigError(f"aggregator.byzantine_num: {rule} needs more than f + 2 = {f + 2} "
                              f"updates per aggregation, {where} {n}; lower "
                              "byzantine_num or sample more clients (asyn.min_received_num)")
    if rule == "centered_clip" and cfg["aggregator.cc_center"] == "median":
        n, where = _per_aggregation(cfg)
        if n < 3:
            raise ConfigError(f"aggregator.cc_center: median needs 3 updates per aggregation or more (the "
                              f"median of two is their mean, which either moves anywhere), {where} {n}; "
                              "sample more clients or use cc_center=previous")
    if rule == "norm_bound" and cfg["aggregator.norm_bound"] is None:
        raise ConfigError("aggregator.norm_bound: robust_rule norm_bound needs a bound, e.g. "
                          "aggregator.norm_bound=1.0")
    if rule == "centered_clip" and cfg["aggregator.cc_tau"] is None:
        raise ConfigError("aggregator.cc_tau: robust_rule centered_clip needs a radius, e.g. "
                          "aggregator.cc_tau=0.1 (about an honest update's norm)")



class _AtTheEdge:
    """`cfg` read as an edge's: its `aggregator.robust_rule` is `topology.edge_robust_rule`."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __getitem__(self, key: str):
        return self.cfg["topology.edge_robust_rule" if key == "aggregator.robust_rule" else key]


@validator
def _check_edge_rule(cfg) -> None:
    if cfg["topology.edge_robust_rule"] == "none":
        return
    if not cfg["topology.edges"]:
        raise ConfigError("topology.edge_robust_rule: a rule for edge aggregators needs "
                          "topology.edges > 0 (in a star, set aggregator.robust_rule)")
    _check_robust(_AtTheEdge(cfg))


def edge_rule(cfg):
    """The rule an edge combines its clients' models with (`topology.edge_robust_rule`), or None;
    each edge gets its own (centered_clip keeps each edge's history)."""
    return make_rule(_AtTheEdge(cfg))

# ---------------------------------------------------------------- the rules on vectors
def squared_distances(vectors: torch.Tensor) -> torch.Tensor:
    """The rows' pairwise squared distances. Squared differences summed, row against rows:
    exactly symmetric, and equal distances stay equal (cdist's square root squared again, or
    its |x|^2 + |y|^2 - 2xy form past 25 rows, rounds them apart and can change the choice
    between near or exact ties); over bands of columns, the bands' matrices add up."""
    return torch.stack([(vectors - v).square_().sum(dim=1) for v in vectors])


def _scores(d2: torch.Tensor, f: int) -> torch.Tensor:
    """Krum score of each row from the squared distances `d2` (overwritten)."""
    d2.fill_diagonal_(math.inf)
    return d2.topk(d2.shape[0] - f - 2, dim=1, largest=False).values.sum(dim=1)


def _check_krum(n: int, f: int) -> None:
    if n - f - 2 < 1:
        raise ValueError(f"Krum needs n > f + 2 updates (n={n}, f={f}); lower "
                         "aggregator.byzantine_num or sample more clients")


def _best(scores: torch.Tensor, m: int) -> list[int]:
    order = sorted(range(len(scores)), key=lambda i: (scores[i].item(), i))
    return order[:max(1, min(m, len(order)))]


def krum_scores(vectors: torch.Tensor, f: int) -> torch.Tensor:
    """Krum score of each row: summed squared distances to its n - f - 2 nearest other rows."""
    _check_krum(vectors.shape[0], f)
    return _scores(squared_distances(vectors), f)


def krum_select(vectors: torch.Tensor, f: int, m: int = 1) -> list[int]:
    """Indices of the `m` best-scored rows (ties broken by index)."""
    return _best(krum_scores(vectors, f), m)


def coordinate_median(vectors: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median (the mean of the two middle values for even n)."""
    return vectors.quantile(0.5, dim=0) if vectors.shape[0] > 1 else vectors[0].clone()


def trimmed_mean(vectors: torch.Tensor, ratio: float) -> torch.Tensor:
    """Per coordinate, drop floor(ratio * n) values at each end and average the rest."""
    n = vectors.shape[0]
    k = int(math.floor(ratio * n))
    if n - 2 * k < 1:
        raise ValueError(f"trimmed mean with trim_ratio {ratio} leaves nothing of {n} updates")
    s = vectors.sort(dim=0).values
    return s[k:n - k].mean(dim=0)


def clip_to_norm(vector: torch.Tensor, bound: float) -> torch.Tensor:
    """`vector` scaled by min(1, bound / ||vector||)."""
    norm = vector.norm().item()
    return vector * (bound / norm) if norm > bound else vector.clone()


def centered_clip(vectors: torch.Tensor, weights: torch.Tensor, center: torch.Tensor, tau: float,
                  iters: int) -> tuple[torch.Tensor, int]:
    """Centered clipping: `iters` times v <- v + sum_i p_i (x_i - v) min(1, tau / ||x_i - v||),
    from v = `center`, p = `weights` normalized. Returns v and how many rows the last
    iteration clipped."""
    p = weights / weights.sum()
    v, clipped = center, 0
    for _ in range(iters):
        diff = vectors - v
        norms = diff.norm(dim=1)
        scale = torch.clamp(tau / norms.clamp_min(1e-300), max=1.0)
        v = v + ((p * scale)[:, None] * diff).sum(dim=0)
        clipped = int((norms > tau).sum().item())
    return v, clipped


# ---------------------------------------------------------------- as a combination rule
def make_rule(cfg):
    """The configured rule as a `BandedRule` (the round's deltas read a band of columns at a
    time, combine.py), or None for `none`. Coordinate-wise rules and the averages of chosen or
    scaled rows are computed band by band, column by column as on the whole matrix (the
    median bit for bit; torch may sum a narrower block's rows in another order, so the others
    to float64 rounding); the distances and norms that Krum, norm_bound and centered_clip
    need are summed over the bands first. A model of up to `combine.ONE_BAND` values is one
    band: exactly the whole matrix's computation."""
    name = cfg["aggregator.robust_rule"]
    if name == "none":
        return None
    f, m = cfg["aggregator.byzantine_num"], cfg["aggregator.krum_m"]
    ratio, bound = cfg["aggregator.trim_ratio"], cfg["aggregator.norm_bound"]
    tau, iters = cfg["aggregator.cc_tau"], cfg["aggregator.cc_iters"]
    # centered_clip: the previous combined delta, the center of the next round; None: the
    # center is each round's coordinate-wise median, and nothing is kept
    history: dict[str, torch.Tensor] | None = {} if cfg["aggregator.cc_center"] == "previous" else None

    def combine(cols: Columns, weights: list[float], client_ids: list[int], round_: int, emit) -> dict:
        metrics: dict = {}
        if name in ("krum", "multi_krum"):
            keep = m if m is not None else (1 if name == "krum" else len(weights) - f)
            _check_krum(len(weights), f)
            d2 = None
            for a, b in cols.bands():
                part = squared_distances(cols.band(a, b))
                d2 = part if d2 is None else d2.add_(part)
            chosen = _best(_scores(d2, f), keep)
            w = torch.tensor([weights[i] for i in chosen], dtype=torch.float64, device=cols.device)
            for a, b in cols.bands():
                emit(a, b, (cols.band(a, b)[chosen] * (w / w.sum())[:, None]).sum(dim=0))
            metrics["robust_selected"] = sorted(client_ids[i] for i in chosen)
        elif name == "median":
            for a, b in cols.bands():
                emit(a, b, coordinate_median(cols.band(a, b)))
        elif name == "trimmed_mean":
            for a, b in cols.bands():
                emit(a, b, trimmed_mean(cols.band(a, b), ratio))
        elif name == "centered_clip":
            metrics["robust_clipped"] = _centered_clip(cols, weights, history, tau, iters, emit)
        else:  # norm_bound
            norms = _row_norms(cols, None)
            scale = torch.clamp(bound / norms.clamp_min(1e-300), max=1.0)
            w = torch.tensor(weights, dtype=torch.float64, device=norms.device)
            for a, b in cols.bands():
                emit(a, b, ((cols.band(a, b) * scale[:, None]) * (w / w.sum())[:, None]).sum(dim=0))
            metrics["robust_clipped"] = int((norms > bound).sum().item())
        return metrics
    return BandedRule(combine)


def _row_norms(cols: Columns, center: torch.Tensor | None) -> torch.Tensor:
    """||x_i - center|| of each row (center None: 0); over several bands, the bands' sums of
    squares add up before the square root."""
    if cols.single:
        block = cols.band(0, cols.n)
        return (block if center is None else block - center).norm(dim=1)
    sums = None
    for a, b in cols.bands():
        block = cols.band(a, b)
        part = (block if center is None else block - center[a:b]).square_().sum(dim=1)
        sums = part if sums is None else sums.add_(part)
    return sums.sqrt_()


def median_reach(vectors: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the width of the interval in which the coordinate-wise median of these
    rows plus one row of any value lies: the most that one more client moves a median (for
    n = 2k + 1 rows in all: h_(k+1) - h_(k) of the others' sorted values; for n = 2k:
    (h_(k+1) - h_(k-1)) / 2, the median being the middle pair's mean). Needs two rows or more."""
    m = vectors.shape[0]
    if m < 2:
        raise ValueError("one client moves the median of two updates anywhere; it needs two others or more")
    h = vectors.sort(dim=0).values
    k = (m + 1) // 2          # n = m + 1 rows in all
    if (m + 1) % 2:           # n odd = 2k + 1: the median is the (k + 1)-th, between h_k and h_(k+1)
        return h[k] - h[k - 1]
    return (h[k] - h[k - 2]) / 2     # n = 2k: between (h_(k-1) + h_k) / 2 and (h_k + h_(k+1)) / 2


def _centered_clip(cols: Columns, weights: list[float], history: dict | None, tau: float, iters: int,
                   emit) -> int:
    """`centered_clip` over the bands, from the last round's combined delta (`history`, where the
    new one is kept) or, with `history` None, from this round's coordinate-wise median."""
    if history is None:
        center = torch.empty(cols.n, dtype=torch.float64, device=cols.device)
        for a, b in cols.bands():
            center[a:b] = coordinate_median(cols.band(a, b))
    else:
        center = history.get("v")
    if center is None or center.shape != (cols.n,):
        center = torch.zeros(cols.n, dtype=torch.float64, device=cols.device)
    w = torch.tensor(weights, dtype=torch.float64, device=cols.device)
    if cols.single:
        v, clipped = centered_clip(cols.band(0, cols.n), w, center, tau, iters)
    else:
        p = w / w.sum()
        v, clipped = center, 0
        for _ in range(iters):
            norms = _row_norms(cols, v)
            scale = torch.clamp(tau / norms.clamp_min(1e-300), max=1.0)
            moved = torch.empty_like(v)
            for a, b in cols.bands():
                diff = cols.band(a, b) - v[a:b]
                moved[a:b] = v[a:b] + ((p * scale)[:, None] * diff).sum(dim=0)
            v = moved
            clipped = int((norms > tau).sum().item())
    if history is not None:
        history["v"] = v
    for a, b in cols.bands():
        emit(a, b, v[a:b])
    return clipped


def install(course) -> None:
    """Behaviour: combine updates on the server with `aggregator.robust_rule`."""
    rule = make_rule(course.cfg)
    if rule is not None and course.server is not None:  # a deployed client has no server
        replace_combination(course.server.aggregator, rule,
                            f"aggregator.robust_rule {course.cfg['aggregator.robust_rule']}")


install.enabled = lambda cfg: cfg["aggregator.robust_rule"] != "none"
registry.behaviours.register("robust_aggregation", install)
