"""Aggregating LoRA adapters, and clients with adapters of their own rank.

A LoRA layer adds ΔW = (alpha / r) B A to a frozen weight. Averaging the
clients' A and B separately (`model.lora.aggregation: separate`) gives
mean(B) mean(A), which is not the mean of the updates, mean(B A): the cross
terms B_i A_j of different clients enter it. It is what most frameworks do
and it is what an algorithm that keeps state on the factors needs (server
optimizers, DiLoCo's outer momentum), but it is an approximation.

`exact` (the default for FedAvg and FedProx) averages the products:
ΔW = Σ_i w_i B_i A_i / Σ_i w_i, and factorizes that again with an SVD,
ΔW = U S Vᵀ: B = U_r S_r, A = V_rᵀ. This is exact whenever rank(ΔW) ≤ r,
which holds when the clients' ranks sum to at most r (the rank of a sum is at
most the sum of the ranks); beyond that it is the best rank-r approximation
(Eckart–Young). The components come ordered by singular value, so a client
of rank r_i < r (`model.lora.ranks`) starts from the first r_i of them, the
best rank-r_i approximation of the global update, and trains only those
(the others are zero in both factors, so their gradients are zero too). Its
update is sent in the global shape, equal to the received adapters beyond r_i
(a zero change there, which compression and local DP encode as such), so the
wire layout is the same for every client and the bytes do not shrink with the
rank. The server reads only the first r_i components of client i's factors
(it knows each client's rank from the config), so whatever a compressor or DP
noise puts beyond r_i never enters the aggregate.

What `exact` aggregates is each client's product, so that is what admission checks
(`product_problem`, declared as the behaviour's `admission_check`): finite factors A_i, B_i
(the wire checks those) can still have a product, or a re-factorized B = U S (whose entries
reach the largest singular value), beyond the model's dtype. A client whose cut product
has a Frobenius norm above the dtype's largest value is refused alone; below it, for every
admitted client, the weighted mean's singular values stay below it too (the spectral norm
of a mean is at most the largest of the spectral norms, each at most its Frobenius norm),
so the aggregate is finite, up to float64 rounding.
"""
from __future__ import annotations

import math

import torch

from fedcore.kernel import registry
from fedcore.kernel.config import declare, validator
from fedcore.algorithms.combine import replace_combination
from fedcore.kernel.contract import FitResult
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrapper
from fedcore.runtime.server_optimizer import from_config as server_optimizer_from_config
from fedcore.scenarios.llm_models import lora_pairs

__all__ = ["exact_lora_mean", "truncate_rank", "client_rank", "product_norm", "product_problem", "install"]

declare("model.lora.aggregation", str, "exact", "how adapters are combined: exact (the weighted mean "
        "of the clients' B A products, re-factorized to rank r with an SVD; FedAvg and FedProx) or "
        "separate (A and B averaged on their own, an approximation; what algorithms with state on "
        "the factors need)", choices=("exact", "separate"))
declare("model.lora.ranks", list, None, "each client's own LoRA rank (client i takes entry "
        "(i-1) mod length, each at most model.lora.r); needs model.lora.aggregation=exact and "
        "executor=sequential")


@validator
def _check_lora(cfg) -> None:
    r, ranks = cfg["model.lora.r"], cfg["model.lora.ranks"]
    if r == 0 or cfg["model.type"] != "causal_lm":
        return
    if ranks is not None:
        if not ranks or not all(isinstance(k, int) and not isinstance(k, bool) and 0 < k <= r
                                for k in ranks):
            raise ConfigError(f"model.lora.ranks: {ranks} must be ranks from 1 to model.lora.r ({r})")
        if cfg["model.lora.aggregation"] != "exact":
            raise ConfigError("model.lora.ranks: clients of their own rank need "
                              "model.lora.aggregation=exact (separate means would mix factors of "
                              "different ranks)")
        if cfg["executor"] != "sequential":
            raise ConfigError("model.lora.ranks: clients of their own rank train with "
                              "executor=sequential")
    if cfg["model.lora.aggregation"] == "exact":
        other = _not_exact(cfg)
        if other:
            raise ConfigError(f"model.lora.aggregation: exact averages the clients' B A products "
                              f"under plain {'/'.join(EXACT_ALGORITHMS)}; {other} needs "
                              "model.lora.aggregation=separate")


EXACT_ALGORITHMS = ("fedavg", "fedprox")


def _not_exact(cfg) -> str | None:
    """What in `cfg` keeps state on the factors or combines them otherwise (None: nothing).
    The SVD picks a new basis for the factors every round, so momentum or moments kept on
    them (server optimizers, DiLoCo) would mix coordinates of different bases; robust rules,
    central DP and secure aggregation combine the factors themselves."""
    if cfg["algorithm.name"] not in EXACT_ALGORITHMS:
        return f"algorithm {cfg['algorithm.name']}"
    if not server_optimizer_from_config(cfg).identity:
        return f"server_optimizer.type={cfg['server_optimizer.type']}"
    if cfg["privacy.dp.mode"] == "central":
        return "privacy.dp.mode=central"
    if cfg["aggregator.robust_rule"] != "none":
        return f"aggregator.robust_rule={cfg['aggregator.robust_rule']}"
    if cfg["secure_aggregation.enabled"]:
        return "secure aggregation"
    return None


def exact_lora_mean(factors: list[tuple[torch.Tensor, torch.Tensor]], weights: list[float],
                    rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of rank `rank` with B A = the rank-`rank` SVD truncation of Σ w_i B_i A_i / Σ w_i
    (exact when the average has rank ≤ `rank`). A has orthonormal rows; B = U S."""
    a0 = factors[0][0]
    total = float(sum(weights))
    delta = sum((w / total) * (b.double() @ a.double()) for (a, b), w in zip(factors, weights))
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    k = min(rank, len(s))
    a = torch.zeros((rank, delta.shape[1]), dtype=torch.float64)
    b = torch.zeros((delta.shape[0], rank), dtype=torch.float64)
    a[:k], b[:, :k] = vh[:k], u[:, :k] * s[:k]
    return a.to(a0.dtype).to(a0.device), b.to(a0.dtype).to(a0.device)


def truncate_rank(state: dict[str, torch.Tensor], pairs, rank: int) -> dict[str, torch.Tensor]:
    """`state` with every adapter's components beyond `rank` zeroed (new tensors for those)."""
    out = dict(state)
    for a, b in pairs:
        if a in out:
            out[a] = out[a].clone()
            out[a][rank:] = 0
            out[b] = out[b].clone()
            out[b][:, rank:] = 0
    return out


def client_rank(cfg, client_id: int) -> int:
    ranks = cfg["model.lora.ranks"]
    return ranks[(client_id - 1) % len(ranks)] if ranks else cfg["model.lora.r"]


def _own_ranks(trainer, pairs) -> None:
    """Each client trains the first `client_rank` components of the received adapters."""
    cfg = trainer.cfg

    def fit(inner, client_id: int, data, received: dict, round_: int) -> FitResult:
        rank = client_rank(cfg, client_id)
        if rank == cfg["model.lora.r"]:
            return inner(client_id, data, received, round_)
        given = received["model"]
        result = inner(client_id, data, {**received, "model": truncate_rank(given, pairs, rank)}, round_)
        sent = result.content["model"]
        for a, b in pairs:   # beyond its rank the client changed nothing: the received values
            sent[a][rank:] = given[a][rank:]
            sent[b][:, rank:] = given[b][:, rank:]
        return result

    # the client trains on truncated adapters: the training itself changes
    trainer.wrap(Wrapper("model.lora.ranks", "fit", fit, process_safe=True))


def _exact_aggregation(aggregator, pairs, rank: int) -> None:
    """The aggregator combines the adapters by `exact_lora_mean` (the other entries as before),
    each client's factors cut to its own rank first."""
    from fedcore.algorithms.fedavg import FedAvgAggregator
    from fedcore.algorithms.fedprox import FedProxAggregator
    if not isinstance(aggregator, (FedAvgAggregator, FedProxAggregator)) \
            or getattr(aggregator.aggregate, "__self__", None) is not aggregator:
        raise ConfigError("model.lora.aggregation: exact needs FedAvg's or FedProx's own mean, which "
                          "another plug-in has replaced here; use model.lora.aggregation=separate")
    cfg = aggregator.cfg

    def exact(deltas, weights, client_ids, round_):
        base = aggregator.global_state
        out = {}
        for a, b in pairs:
            if a in deltas[0]:
                ba, bb = base[a].double(), base[b].double()
                factors = [_cut(ba + d[a], bb + d[b], client_rank(cfg, cid)) for d, cid in zip(deltas, client_ids)]
                new_a, new_b = exact_lora_mean(factors, weights, rank)
                out[a], out[b] = new_a - ba, new_b - bb
        return out, {}

    replace_combination(aggregator, exact, "model.lora.aggregation exact")


def _cut(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors (A, B) with the components beyond `rank` zeroed (the tensors are the caller's own)."""
    a[rank:] = 0
    b[:, rank:] = 0
    return a, b


def product_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||B A||_F (float64) from the r x r Gram matrices, ||B A||_F^2 = sum((Bᵀ B) * (A Aᵀ)), not
    from the d_out x d_in product; each factor is first divided by its largest magnitude, so
    finite factors cannot overflow on the way. inf for a factor that is not finite."""
    a, b = a.detach().double(), b.detach().double()
    if not a.numel() or not b.numel():
        return 0.0
    sa, sb = float(a.abs().max()), float(b.abs().max())
    if not (math.isfinite(sa) and math.isfinite(sb)):
        return math.inf
    if sa == 0.0 or sb == 0.0:
        return 0.0
    a, b = a / sa, b / sb
    gram = float(((b.T @ b) * (a @ a.T)).sum())
    return math.sqrt(max(gram, 0.0)) * (sa * sb)


def product_problem(server, update) -> tuple[str, str] | None:
    """Admission's check of an update under `exact` aggregation: each adapter's product
    B_i A_i, cut to the client's rank as the aggregation reads it, must have a Frobenius norm
    the model's dtype can hold. (kind, why) of the first that does not, else None."""
    cfg = server.course.cfg
    model = update.content.get("model")
    if cfg["model.lora.r"] == 0 or cfg["model.lora.aggregation"] != "exact" or not isinstance(model, dict):
        return None
    rank = client_rank(cfg, update.client_id)
    for a, b in lora_pairs(model):
        norm, dtype = product_norm(model[a][:rank], model[b][:, :rank]), model[a].dtype
        if not norm <= torch.finfo(dtype).max:
            return ("LoRA product beyond the model's dtype",
                    f"adapter '{a}': the product B A has Frobenius norm {norm:.3g}, beyond "
                    f"{str(dtype).removeprefix('torch.')}'s largest value")
    return None


def install(course) -> None:
    """Give clients their ranks and the server exact aggregation (the summary's parameter
    counts, the adapters' against the whole model's, are every course's: runtime/course.py)."""
    cfg = course.cfg
    trainer, server = getattr(course, "trainer", None), getattr(course, "server", None)
    model = trainer.model if trainer is not None else server.model
    if cfg["model.lora.r"] == 0:
        return
    pairs = lora_pairs(model.state_dict())
    if trainer is not None and cfg["model.lora.ranks"]:
        _own_ranks(trainer, pairs)
    if server is not None and cfg["model.lora.aggregation"] == "exact":
        _exact_aggregation(server.aggregator, pairs, cfg["model.lora.r"])


install.enabled = lambda cfg: cfg["model.type"] == "causal_lm"
install.admission_check = product_problem
registry.behaviours.register("language_model", install)
