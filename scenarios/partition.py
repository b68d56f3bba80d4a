"""Partitioners: split a dataset's sample indices among N clients, seeded.

Each takes `(raw, n_clients, cfg)` and returns a list of N index arrays.
"""
from __future__ import annotations

import numpy as np

from fedcore.errors import ConfigError
from fedcore.registry import partitioners
from fedcore.scenarios.data import RawDataset

__all__ = ["iid", "dirichlet", "natural"]


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
