"""Partitioners: split a dataset's sample indices among N clients, seeded.

Each takes `(raw, n_clients, cfg)` and returns a list of N index arrays that
together hold every sample exactly once (`natural` leaves out the groups
beyond the first N).
"""
from __future__ import annotations

import numpy as np

from fedcore.kernel.config import declare, non_negative, positive
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import partitioners
from fedcore.scenarios.data import RawDataset

__all__ = ["iid", "dirichlet", "natural", "shards", "quantity", "allocate_sizes"]

declare("data.shards_per_client", int, 2, "shards: how many distinct labels each client holds "
        "(McMahan et al. use 2)", check=positive)
declare("data.quantity.dist", str, "lognormal", "quantity: distribution of client sizes",
        choices=("lognormal", "powerlaw"))
declare("data.quantity.sigma", float, 1.0, "quantity: lognormal sigma of the size weights "
        "(0 gives equal sizes)", check=non_negative)
declare("data.quantity.exponent", float, 1.5, "quantity: Pareto tail exponent of the size weights "
        "(smaller is more skewed)", check=positive)


@partitioners.register("iid")
def iid(raw: RawDataset, n: int, cfg) -> list[np.ndarray]:
    """A uniform random split into N near-equal shares."""
    rng = np.random.default_rng(cfg["seed"] + 1)
    return np.array_split(rng.permutation(len(raw.y)), n)


@partitioners.register("dirichlet")
def dirichlet(raw: RawDataset, n: int, cfg) -> list[np.ndarray]:
    """Label skew: each class is spread over clients by proportions ~ Dir(alpha).

    Resampled until every client holds at least `data.min_size` samples.
    """
    alpha, min_size = cfg["data.alpha"], cfg["data.min_size"]
    labels = raw.y.numpy().astype(np.int64)
    if min_size * n > len(labels):
        raise ConfigError(f"data.min_size: {min_size} x {n} clients exceeds the {len(labels)} samples")
    rng = np.random.default_rng(cfg["seed"] + 2)
    classes = np.unique(labels)
    for _ in range(1000):
        shares: list[list[int]] = [[] for _ in range(n)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            p = rng.dirichlet(np.full(n, alpha))
            cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
            for k, part in enumerate(np.split(idx, cuts)):
                shares[k].extend(part.tolist())
        if min(len(s) for s in shares) >= min_size:
            return [np.array(sorted(s), dtype=np.int64) for s in shares]
    raise ConfigError(f"data.min_size: no Dirichlet(alpha={alpha}) split gave every client "
                      f"{min_size} samples in 1000 tries; lower data.min_size or raise data.alpha")


@partitioners.register("natural")
def natural(raw: RawDataset, n: int, cfg) -> list[np.ndarray]:
    """One client per natural group (writer, user, device, client_column value)."""
    if raw.groups is None:
        raise ConfigError(f"data.partition: natural needs a dataset with natural groups; "
                          f"'{cfg['data.type']}' has none")
    groups = np.unique(raw.groups)
    if len(groups) < n:
        raise ConfigError(f"federate.client_num: {n} clients but the data has only {len(groups)} "
                          "natural groups")
    return [np.flatnonzero(raw.groups == g) for g in groups[:n]]


@partitioners.register("shards")
def shards(raw: RawDataset, n: int, cfg) -> list[np.ndarray]:
    """Pathological label skew: every client holds exactly k distinct labels.

    Labels are laid out in a seeded random cyclic order and client i takes the
    k consecutive labels starting at position i*k, so labels are shared as
    evenly as possible; each label's samples are then split into equal shards
    among the clients holding it.
    """
    k = cfg["data.shards_per_client"]
    labels = raw.y.numpy().astype(np.int64)
    classes = np.unique(labels)
    if k > len(classes):
        raise ConfigError(f"data.shards_per_client: {k} exceeds the {len(classes)} labels in the data")
    if n * k < len(classes):
        raise ConfigError(f"data.shards_per_client: {n} clients x {k} labels cannot cover all "
                          f"{len(classes)} labels; raise data.shards_per_client or federate.client_num")
    rng = np.random.default_rng(cfg["seed"] + 3)
    order = rng.permutation(classes)
    slots = rng.permutation(n)  # which client takes which run of labels
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for pos, client in enumerate(slots):
        for j in range(k):
            holders[int(order[(pos * k + j) % len(order)])].append(int(client))
    shares: list[list[np.ndarray]] = [[] for _ in range(n)]
    for c, owners in holders.items():
        idx = rng.permutation(np.flatnonzero(labels == c))
        if len(idx) < len(owners):
            raise ConfigError(f"data.shards_per_client: label {c} has {len(idx)} samples for "
                              f"{len(owners)} clients; lower data.shards_per_client or client_num")
        for client, part in zip(owners, np.array_split(idx, len(owners))):
            shares[client].append(part)
    return [np.sort(np.concatenate(s)).astype(np.int64) for s in shares]


def allocate_sizes(weights: np.ndarray, total: int, min_size: int) -> np.ndarray:
    """Integer sizes summing to `total`: `min_size` each, the rest proportional to `weights`.

    The remainder left by rounding down goes to the largest fractional parts.
    """
    n = len(weights)
    spare = total - n * min_size
    if spare < 0:
        raise ConfigError(f"data.min_size: {min_size} x {n} clients exceeds the {total} samples")
    share = weights / weights.sum() * spare
    sizes = np.floor(share).astype(np.int64)
    short = spare - int(sizes.sum())
    sizes[np.argsort(-(share - sizes), kind="stable")[:short]] += 1
    return sizes + min_size


@partitioners.register("quantity")
def quantity(raw: RawDataset, n: int, cfg) -> list[np.ndarray]:
    """Quantity skew: iid labels, client sizes proportional to lognormal or Pareto weights.

    Every client gets at least `data.min_size` samples.
    """
    q = cfg.section("data.quantity")
    rng = np.random.default_rng(cfg["seed"] + 4)
    if q["dist"] == "lognormal":
        weights = rng.lognormal(0.0, q["sigma"], n)
    else:
        weights = rng.pareto(q["exponent"], n) + 1.0
    sizes = allocate_sizes(weights, len(raw.y), cfg["data.min_size"])
    perm = rng.permutation(len(raw.y))
    return [np.sort(p).astype(np.int64) for p in np.split(perm, np.cumsum(sizes)[:-1])]
