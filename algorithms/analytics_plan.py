"""The analytics course's configuration: its keys, their checks, the noise multiplier that meets
a target epsilon, and the `Plan` (columns, bounds, bins, groups) every party derives from the
config and the data's shape. Each problem is a ConfigError naming its key (exit 2)."""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.algorithms import analytics_stats as st
from fedcore.algorithms.dp_accountant import dp_epsilon
from fedcore.algorithms.dp_noise import resolved_noise_source
from fedcore.kernel.config import declare, positive, resolver, validator
from fedcore.kernel.errors import ConfigError

__all__ = ["plan_of", "noise_multiplier", "MAX_MULTIPLIER"]

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
        for key, own in (("algorithm.name", "analytics"), ("course", "analytics"),
                         ("model.type", "analytics_request")):
            if cfg[key] == own:   # set alone, the course would fail at its first message
                raise ConfigError(f"{key}: {own} belongs to task: analytics, which sets it with "
                                  "the rest of the course; set task=analytics instead")
        return
    asked = cfg["analytics.statistics"]
    unknown = [s for s in asked if s not in st.STATISTICS]
    if not asked or unknown:
        raise ConfigError(f"analytics.statistics: {unknown[0] if unknown else 'empty'!r} is not a "
                          f"statistic; choose from {', '.join(st.STATISTICS)}")
    # every client, every round, in a star: the one flow the analytics course runs
    for key, default, as_text in (("topology.edges", 0, "0"), ("asyn.use", False, "false"),
                                  ("executor", "sequential", "sequential")):
        if cfg[key] != default:
            raise ConfigError(f"{key}: task: analytics asks every client for its sums each round, in "
                              f"a star, one client after another; set {key}={as_text}")
    for q in cfg["analytics.quantiles"]:
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 1:
            raise ConfigError(f"analytics.quantiles: {q!r} is not a number in [0, 1]")
    if cfg["privacy.dp.mode"] != "none":
        raise ConfigError("privacy.dp.mode: DP of model updates does not apply to task: analytics; set "
                          "privacy.dp.mode=none and analytics.dp.epsilon for DP statistics")
    extremes = [s for s in asked if s in ("min", "max")]
    if extremes and cfg["secure_aggregation.enabled"]:
        raise ConfigError(f"analytics.statistics: {extremes[0]} is one record's value, not a sum, and "
                          "secure aggregation reveals only sums; ask quantiles [0, 1] instead")
    if cfg["analytics.dp.epsilon"] is not None:
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
                if not math.isfinite(float(row[name])):
                    raise ValueError
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
