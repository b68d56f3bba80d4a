"""Federated statistics (`task: analytics`): the plug-ins of a course whose "update" is a
vector of sums (algorithms/analytics_stats.py says which sums and why they are exact).

The client half (`AnalyticsTrainer`) turns the server's request and the client's rows into
its integer sums; the server half (`AnalyticsAggregator`) adds them exactly, adds DP noise
when asked (sigma from the bounds and the noise multiplier that meets the target epsilon),
plans the next quantile-refinement round and, after the last, holds the statistics. The
"model" (`analytics_request`) is only the request the server broadcasts: the intervals the
quantiles are refined in.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedcore.algorithms import analytics_stats as st
from fedcore.algorithms.dp_accountant import RdpAccountant, dp_epsilon
from fedcore.algorithms.dp_noise import noise_source, resolved_noise_source, standard_normal
from fedcore.kernel.config import declare, positive, resolver, validator
from fedcore.kernel.contract import Aggregator, Algorithm, FitResult, ReceivedUpdate
from fedcore.kernel.errors import ConfigError, NothingAggregated
from fedcore.kernel.hooks import Wrappable
from fedcore.kernel.registry import algorithms, models

__all__ = ["AnalyticsTrainer", "AnalyticsAggregator", "ANALYTICS", "plan_of", "noise_multiplier",
           "rows_of", "MAX_MULTIPLIER"]

declare("analytics.statistics", list, ["count", "mean", "variance"], "task: analytics: the statistics "
        f"computed for each column and group, any of {', '.join(st.STATISTICS)}")
declare("analytics.columns", list, None, "task: analytics: the numeric columns to describe (csv: "
        "header names; wine: its feature names; other data: x0, x1, ... over the flattened "
        "features); null: every feature column")
declare("analytics.group_by", str, None, "task: analytics: the label column (data.label_column for "
        "csv, 'class' for wine, 'label' otherwise): statistics per class; null: one group 'all'")
declare("analytics.bounds", dict, {}, "task: analytics: {column: [lo, hi]} for every column; values "
        "are clipped to them, histograms and quantiles span them, DP's sensitivity comes from them")
declare("analytics.bins", int, 10, "task: analytics: equal-width histogram bins over a column's "
        "bounds (unless analytics.bin_edges names the column)", check=positive)
declare("analytics.bin_edges", dict, {}, "task: analytics: {column: [e0, e1, ...]} histogram edges, "
        "increasing, covering the column's bounds (e0 <= lo, hi <= last); bins as numpy's histogram")
declare("analytics.quantiles", list, [0.25, 0.5, 0.75], "task: analytics: quantiles q in [0, 1] "
        "(numpy's inverted_cdf: the ceil(q n)-th smallest value) found by histogram refinement")
declare("analytics.quantile_bins", int, 16, "task: analytics: bins of each refinement round "
        "(each round divides the quantile's interval by this)",
        check=lambda v: None if v >= 2 else f"must be >= 2, got {v}")
declare("analytics.quantile_rounds", int, 4, "task: analytics: rounds of quantile refinement (the "
        "course's rounds when quantiles are asked; the final interval is (hi - lo) / bins^rounds)",
        check=positive)
declare("analytics.fraction_bits", int, 64, "task: analytics: F: sums are exact for values that are "
        "multiples of 2^-F (others are rounded to one first)",
        check=lambda v: None if 0 <= v <= 1024 else f"must be in [0, 1024], got {v}")
declare("analytics.dp.epsilon", float, None, "task: analytics: target epsilon of the released sums "
        "(Gaussian noise, RDP accountant over the course's rounds); null: no DP", check=positive)
declare("analytics.dp.delta", float, 1e-5, "task: analytics: delta of analytics.dp.epsilon",
        check=lambda v: None if 0 < v < 1 else f"must be in (0, 1), got {v}")

MAX_MULTIPLIER = 1e6   # beyond this the noise is the release: a target needing more is refused


def _rounds(values) -> int:
    asked = values["analytics.statistics"] or []
    return values["analytics.quantile_rounds"] if "quantiles" in asked else 1


@resolver
def _analytics_course(values: dict) -> None:
    """`task: analytics` runs the analytics course, its plug-ins and its number of rounds."""
    if values["task"] != "analytics":
        return
    values.update({"course": "analytics", "algorithm.name": "analytics", "model.type": "analytics_request",
                   "model.dtype": "float64", "federate.total_round_num": _rounds(values),
                   "federate.sample_client_num": None, "federate.sample_client_rate": None})


@validator
def _check_analytics(cfg) -> None:
    if cfg["task"] != "analytics":
        return
    asked = cfg["analytics.statistics"]
    unknown = [s for s in asked if s not in st.STATISTICS]
    if not asked or unknown:
        raise ConfigError(f"analytics.statistics: {unknown[0] if unknown else 'empty'!r} is not a "
                          f"statistic; choose from {', '.join(st.STATISTICS)}")
    for q in cfg["analytics.quantiles"]:
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 1:
            raise ConfigError(f"analytics.quantiles: {q!r} is not a number in [0, 1]")
    if cfg["secure_aggregation.enabled"]:
        extremes = [s for s in asked if s in ("min", "max")]
        if extremes:
            raise ConfigError(f"analytics.statistics: {extremes[0]} is one record's value, not a sum, and "
                              "secure aggregation reveals only sums; ask quantiles [0, 1] instead")
    if cfg["analytics.dp.epsilon"] is not None:
        extremes = [s for s in asked if s in ("min", "max")]
        if extremes:
            raise ConfigError(f"analytics.statistics: {extremes[0]} is one record's value and has no "
                              "DP release; with analytics.dp.epsilon ask quantiles [0, 1] instead")
        noise_multiplier(cfg)
        if cfg["federate.mode"] == "distributed" or cfg.get("distribute.role") is not None:
            if resolved_noise_source(cfg) == "seeded" and not cfg["privacy.dp.seeded_noise_in_deployment"]:
                raise ConfigError("privacy.dp.noise_source: seeded noise in a deployment can be "
                                  "regenerated and removed by anyone holding the config; use auto or os")
    if cfg["data.type"] == "csv" and cfg["data.root"] and Path(cfg["data.root"]).is_file():
        _check_csv_columns(cfg)


def noise_multiplier(cfg) -> float:
    """z: the least noise multiplier whose epsilon, by the RDP accountant over the course's
    rounds (each a Gaussian release of all sums, sensitivity 1 after rescaling), is at most
    `analytics.dp.epsilon` at `analytics.dp.delta` (bisection on log z)."""
    target, delta, rounds = cfg["analytics.dp.epsilon"], cfg["analytics.dp.delta"], _rounds(cfg)
    def eps(z: float) -> float:
        return dp_epsilon(1.0, z, rounds, delta)
    if eps(MAX_MULTIPLIER) > target:
        raise ConfigError(f"analytics.dp.epsilon: {target:g} cannot be met at delta {delta:g} over "
                          f"{rounds} round(s): the accountant gives {eps(MAX_MULTIPLIER):.4g} even at "
                          f"noise multiplier {MAX_MULTIPLIER:g}; raise analytics.dp.epsilon or "
                          "analytics.dp.delta")
    lo, hi = math.log(1e-3), math.log(MAX_MULTIPLIER)
    if eps(math.exp(lo)) <= target:
        return math.exp(lo)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps(math.exp(mid)) <= target else (mid, hi)
    return math.exp(hi)


def _csv_header_rows(cfg) -> tuple[list[str], list[dict[str, str]]]:
    with Path(cfg["data.root"]).expanduser().open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _check_csv_columns(cfg) -> None:
    """A statistic over a column the CSV does not hold as numbers is refused by name."""
    header, rows = _csv_header_rows(cfg)
    label, client = cfg["data.label_column"], cfg["data.client_column"]
    for name in cfg["analytics.columns"] or []:
        if name in (label, client):
            kind = "label" if name == label else "client"
            raise ConfigError(f"analytics.columns: '{name}' is the {kind} column, which the data hold as "
                              "names, not numbers; describe a numeric column"
                              + (" (and group by this one with analytics.group_by)" if kind == "label" else ""))
        if name not in header:
            continue   # named in plan_of, against the features the data hold
        for i, row in enumerate(rows, start=2):
            try:
                float(row[name])
            except (TypeError, ValueError):
                raise ConfigError(f"analytics.columns: column '{name}' of '{cfg['data.root']}' is not "
                                  f"numeric (line {i}: {row[name]!r}); describe a numeric column") from None


# ------------------------------------------------------------------ the plan from the config
def _feature_names(cfg, width: int) -> list[str]:
    if cfg["data.type"] == "csv":
        header, _ = _csv_header_rows(cfg)
        return [c for c in header if c not in (cfg["data.label_column"], cfg["data.client_column"])]
    if cfg["data.type"] == "wine":
        from fedcore.scenarios.datasets.wine import FEATURES
        return list(FEATURES)
    return [f"x{i}" for i in range(width)]


def _group_names(cfg, num_classes: int) -> tuple[str, list[str]]:
    """(the label column's name, the class names in label order)."""
    if cfg["data.type"] == "csv":
        from fedcore.scenarios.datasets.tabular import natural_key
        _, rows = _csv_header_rows(cfg)
        return cfg["data.label_column"], sorted({r[cfg["data.label_column"]] for r in rows}, key=natural_key)
    if cfg["data.type"] == "wine":
        from fedcore.scenarios.datasets.wine import CLASSES
        return "class", list(CLASSES)
    return "label", [str(i) for i in range(num_classes)]


def _pair(value: Any, key: str, name: str) -> tuple[float, float]:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not ok or not value[0] < value[1]:
        raise ConfigError(f"{key}: bounds of '{name}' must be [lo, hi] with finite lo < hi, got {value!r}")
    return float(value[0]), float(value[1])


def _edges(cfg, name: str, lo: float, hi: float) -> tuple[float, ...]:
    given = (cfg["analytics.bin_edges"] or {}).get(name)
    if given is None:
        return tuple(float(e) for e in np.linspace(lo, hi, cfg["analytics.bins"] + 1))
    if not isinstance(given, list) or len(given) < 2 or not all(
            isinstance(e, (int, float)) and not isinstance(e, bool) for e in given):
        raise ConfigError(f"analytics.bin_edges: edges of '{name}' must be a list of at least two numbers")
    edges = [float(e) for e in given]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ConfigError(f"analytics.bin_edges: edges of '{name}' must increase strictly, got {given}")
    if edges[0] > lo or edges[-1] < hi:
        raise ConfigError(f"analytics.bin_edges: edges of '{name}' [{edges[0]:g} ... {edges[-1]:g}] do not "
                          f"cover its bounds [{lo:g}, {hi:g}]; start at or below lo and end at or above hi")
    return tuple(edges)


def plan_of(cfg, input_shape: tuple[int, ...], num_classes: int) -> st.Plan:
    """The course's plan from its config and its data's shape; a column, bound or edge that does
    not fit is a ConfigError naming its key."""
    width = math.prod(input_shape)
    names = _feature_names(cfg, width)
    if len(names) != width:
        raise ConfigError(f"data.type: {cfg['data.type']} rows hold {width} features, the column names "
                          f"{len(names)}")
    asked = cfg["analytics.columns"] or names
    bounds = cfg["analytics.bounds"] or {}
    columns = []
    for name in asked:
        if name not in names:
            raise ConfigError(f"analytics.columns: no numeric column '{name}' (columns: {', '.join(names)})")
        if name not in bounds:
            raise ConfigError(f"analytics.bounds: column '{name}' has no bounds; give {name}: [lo, hi]")
        lo, hi = _pair(bounds[name], "analytics.bounds", name)
        columns.append(st.Column(name, names.index(name), lo, hi, _edges(cfg, name, lo, hi)))
    groups = ["all"]
    if cfg["analytics.group_by"] is not None:
        label, groups = _group_names(cfg, num_classes)
        if cfg["analytics.group_by"] != label:
            raise ConfigError(f"analytics.group_by: '{cfg['analytics.group_by']}' is not the label column "
                              f"of data.type {cfg['data.type']} ('{label}')")
    return st.Plan(frozenset(cfg["analytics.statistics"]), tuple(columns), tuple(groups),
                   tuple(float(q) for q in cfg["analytics.quantiles"]), cfg["analytics.quantile_bins"],
                   cfg["analytics.quantile_rounds"], cfg["analytics.fraction_bits"])


class AnalyticsRequest(nn.Module):
    """What the server broadcasts: the quantile intervals being refined, rows (a, b, closed)."""

    def __init__(self, plan: st.Plan):
        super().__init__()
        self.plan = plan
        self.register_buffer("request", torch.zeros(0, 3, dtype=torch.float64))


@models.register("analytics_request")
def analytics_request(cfg, input_shape, num_classes: int) -> nn.Module:
    return AnalyticsRequest(plan_of(cfg, tuple(input_shape), num_classes))


def rows_of(data) -> tuple[np.ndarray, np.ndarray]:
    """A client's whole table (train, val and test rows) as float64 rows and label indices."""
    splits = [getattr(data, f) for f in ("train", "val", "test") if hasattr(data, f)]
    x = torch.cat([s.x.reshape(len(s.y), -1) for s in splits]) if splits else torch.zeros(0, 0)
    y = torch.cat([s.y for s in splits]) if splits else torch.zeros(0, dtype=torch.long)
    return x.to(torch.float64).cpu().numpy(), y.cpu().numpy().astype(np.int64)


def _targets(request: torch.Tensor, plan: st.Plan) -> list[st.Target]:
    """The targets a request names, in the plan's order (column, group, quantile)."""
    rows = request.tolist()
    order = [(c, g, q) for c in range(len(plan.columns)) for g in range(len(plan.groups)) for q in plan.quantiles]
    return [st.Target(c, g, q, a, b, bool(closed), 0.0) for (c, g, q), (a, b, closed) in zip(order, rows)]


# ------------------------------------------------------------------ the plug-ins
class AnalyticsTrainer(Wrappable):
    """Client side: its rows' sums for the round's request."""

    tensor_form = "torch"

    def __init__(self, model: AnalyticsRequest, cfg, store):
        self.model, self.cfg, self.store, self.plan = model, cfg, store, model.plan
        self.device = torch.device("cpu")

    def fit(self, client_id: int, data, received: dict, round_: int) -> FitResult:
        rows, groups = rows_of(data)
        if self.plan.groups == ("all",):
            groups = np.zeros(len(groups), dtype=np.int64)
        request = received["model"]["request"]
        if request.shape[0] == 0:   # round 1: counts, sums, histograms (and min/max)
            sums = st.local_sums(self.plan, rows, groups, st.base_blocks(self.plan))
            extremes = st.local_extremes(self.plan, rows, groups) if self.plan.extremes else []
        else:
            sums = st.local_sums(self.plan, rows, groups, st.refine_blocks(self.plan), _targets(request, self.plan))
            extremes = []
        content = {"sums": torch.tensor(sums, dtype=torch.int64),
                   "extremes": torch.tensor(extremes, dtype=torch.float64), "num_samples": len(rows)}
        return FitResult(content, float(len(rows)))

    def evaluate(self, client_id: int, data, received: dict) -> dict[str, float]:
        return {}


class AnalyticsAggregator(Aggregator):
    """Server side: exact sums, DP noise, the refinement plan, and the statistics at the end."""

    def __init__(self, model: AnalyticsRequest, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        self.plan = model.plan
        self.multiplier = noise_multiplier(cfg) if cfg["analytics.dp.epsilon"] is not None else None
        self.accountant = RdpAccountant()
        self.targets: list[st.Target] = []
        self.base: tuple[list[st.Block], list[list[Any]], np.ndarray | None] | None = None
        self.sigmas: dict[int, list[float]] = {}
        self.statistics: dict[str, Any] | None = None

    def blocks(self, round_: int) -> list[st.Block]:
        return st.base_blocks(self.plan) if round_ == 1 else st.refine_blocks(self.plan)

    def masked_length(self, round_: int) -> int:
        """Under secure aggregation: a client's masked vector, its sums and its weight."""
        return sum(b.length for b in self.blocks(round_)) + 1

    def noise(self, blocks: list[st.Block], values: list[list[Any]], round_: int) -> list[np.ndarray] | None:
        """Each block's Gaussian noise (sigma from `block_sigmas`), drawn as DP noise is drawn:
        seeded in simulation, from the OS in deployment (`privacy.dp.noise_source`)."""
        if self.multiplier is None:
            return None
        sigmas = st.block_sigmas(blocks, self.multiplier)
        self.sigmas[round_] = sigmas
        draws = standard_normal(sum(len(v) for v in values), noise_source(self.cfg, 0, round_)).numpy()
        out, pos = [], 0
        for sigma, v in zip(sigmas, values):
            out.append(draws[pos:pos + len(v)] * sigma)
            pos += len(v)
        self.accountant.step(1.0, self.multiplier)
        return out

    # a secure round that is skipped (too few survivors) reaches `aggregate` with no sums: a
    # statistic of the union cannot do without a round, so the course stops there
    releases_empty_rounds = True

    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        if not updates:
            raise NothingAggregated(f"analytics: round {round_} has no sums (a secure round was skipped); "
                                    "a statistic of the union cannot skip a round")
        blocks = self.blocks(round_)
        ordered = sorted(updates, key=lambda u: u.client_id)
        sums = st.combine(blocks, [u.content["sums"].numpy() for u in ordered])
        values = st.released(self.plan, blocks, sums, None)
        noisy = self.noise(blocks, values, round_)
        if noisy is not None:
            values = st.released(self.plan, blocks, sums, noisy)
        fields: dict[str, float] = {"analytics_round": round_}
        if round_ == 1:
            extremes = None
            if self.plan.extremes:
                ext = np.stack([u.content["extremes"].numpy() for u in ordered]).reshape(len(ordered), -1, 2)
                extremes = np.stack([ext[:, :, 0].min(0), ext[:, :, 1].max(0)], axis=1).reshape(-1)
            self.base = (blocks, values, extremes)
            counts = values[0]
            fields["analytics_rows"] = float(sum(float(c) for c in counts))
            if "quantiles" in self.plan.statistics:
                self.targets = st.first_targets(self.plan, blocks, values)
        else:
            self.targets = st.next_targets(self.plan, self.targets, values, self.base[1][0])
        if self.targets:
            widths = [t.b - t.a for t in self.targets]
            fields["analytics_quantile_width"] = max(widths)
        if round_ < self.plan.rounds:
            self.global_state = {"request": torch.tensor([[t.a, t.b, float(t.closed)] for t in self.targets],
                                                         dtype=torch.float64).reshape(-1, 3)}
        else:
            self.statistics = st.results(self.plan, *self.base, self.targets)
        return fields

    def privacy(self) -> dict[str, Any]:
        """What the summary says of DP: epsilon spent by the accountant, delta, z and sigmas."""
        if self.multiplier is None:
            return {}
        delta = self.cfg["analytics.dp.delta"]
        return {"analytics_dp_epsilon": self.accountant.epsilon(delta), "analytics_dp_delta": delta,
                "analytics_dp_target_epsilon": self.cfg["analytics.dp.epsilon"],
                "analytics_noise_multiplier": self.multiplier}


def update_layout(server) -> dict[str, Any]:
    """What a deployed server accepts as a client's sums: the round's vector lengths, no more."""
    agg = server.aggregator
    blocks = agg.blocks(server.round)
    want = sum(b.length for b in blocks)
    ext = 2 * len(agg.plan.columns) * len(agg.plan.groups) if agg.plan.extremes and server.round == 1 else 0

    def sums(value, _server) -> str | None:
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or tuple(value.shape) != (want,):
            return f"analytics sums must be {want} int64 values"
        if value.numel() and (int(value.min()) < 0 or int(value.max()) >= 1 << st.ROW_BITS):
            return "analytics sums must lie in [0, 2^40)"
        return None

    def extremes(value, _server) -> str | None:
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float64 or tuple(value.shape) != (ext,):
            return f"analytics extremes must be {ext} float64 values"
        if value.numel() and not bool(torch.isfinite(value).all()):
            return "analytics extremes must be finite"
        return None
    return {"sums": sums, "extremes": extremes}


ANALYTICS = algorithms.register("analytics", Algorithm(AnalyticsTrainer, AnalyticsAggregator, update_layout))
