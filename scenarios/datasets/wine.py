"""`wine`: scikit-learn's bundled wine recognition table (178 wines, 13 chemical measurements,
3 cultivars; no download), kept in float64 as published, for analytics and small models."""
from __future__ import annotations

import numpy as np
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset, hold_out

__all__ = ["wine", "FEATURES", "CLASSES"]

# scikit-learn's feature and class names, in its column order (load_wine().feature_names)
FEATURES = ("alcohol", "malic_acid", "ash", "alcalinity_of_ash", "magnesium", "total_phenols",
            "flavanoids", "nonflavanoid_phenols", "proanthocyanins", "color_intensity", "hue",
            "od280/od315_of_diluted_wines", "proline")
CLASSES = ("class_0", "class_1", "class_2")


@datasets.register("wine")
def wine(cfg) -> RawDataset:
    """Rows of the 13 features, labels the cultivar; `data.test_size` of them go to the server."""
    try:
        from sklearn.datasets import load_wine
    except ImportError:
        raise ConfigError("data.type: wine needs scikit-learn (pip install 'fedcore[data]' or "
                          "pip install scikit-learn)") from None
    bunch = load_wine()
    x = torch.from_numpy(np.asarray(bunch.data, dtype=np.float64))
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    return hold_out(RawDataset(x, y, len(CLASSES)), cfg["data.test_size"], cfg["seed"])
