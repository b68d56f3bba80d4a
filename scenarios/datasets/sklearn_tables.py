"""`breast_cancer` (569 rows, 30 features, 2 classes) and `diabetes` (442 rows, 10 features, a
numeric target): scikit-learn's bundled tables (no download), in float64 as published, for
tree courses and small models. `diabetes` is a regression table: its labels are numbers."""
from __future__ import annotations

import numpy as np
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset, hold_out

__all__ = ["breast_cancer", "diabetes"]


def _load(name: str):
    try:
        import sklearn.datasets as skd
    except ImportError:
        raise ConfigError(f"data.type: {name} needs scikit-learn (pip install 'fedcore[data]' or "
                          "pip install scikit-learn)") from None
    return getattr(skd, f"load_{name}")()


@datasets.register("breast_cancer")
def breast_cancer(cfg) -> RawDataset:
    """Rows of the 30 features, labels 0 (malignant) / 1 (benign); `data.test_size` to the server."""
    bunch = _load("breast_cancer")
    x = torch.from_numpy(np.asarray(bunch.data, dtype=np.float64))
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    return hold_out(RawDataset(x, y, 2), cfg["data.test_size"], cfg["seed"])


@datasets.register("diabetes")
def diabetes(cfg) -> RawDataset:
    """Rows of the 10 (scaled) features, labels the disease progression after a year (a number);
    partitions that read classes (dirichlet, shards) do not apply: use iid or quantity."""
    if cfg["data.partition"] in ("dirichlet", "shards", "dirichlet_groups"):
        raise ConfigError(f"data.partition: {cfg['data.partition']} splits by class and diabetes has a "
                          "numeric target; use data.partition=iid or quantity")
    bunch = _load("diabetes")
    x = torch.from_numpy(np.asarray(bunch.data, dtype=np.float64))
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.float64))
    return hold_out(RawDataset(x, y, 1), cfg["data.test_size"], cfg["seed"])
