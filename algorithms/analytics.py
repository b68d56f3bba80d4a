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

from typing import Any

import numpy as np
import torch
from torch import nn

from fedcore.algorithms import analytics_stats as st
from fedcore.algorithms.analytics_plan import MAX_MULTIPLIER, noise_multiplier, plan_of
from fedcore.algorithms.dp_accountant import RdpAccountant
from fedcore.algorithms.dp_noise import noise_source, standard_normal
from fedcore.kernel.contract import Aggregator, Algorithm, FitResult, ReceivedUpdate
from fedcore.kernel.errors import NothingAggregated
from fedcore.kernel.hooks import Wrappable
from fedcore.kernel.registry import algorithms, models

__all__ = ["AnalyticsTrainer", "AnalyticsAggregator", "ANALYTICS", "plan_of", "noise_multiplier",
           "rows_of", "MAX_MULTIPLIER", "AnalyticsRequest"]


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
