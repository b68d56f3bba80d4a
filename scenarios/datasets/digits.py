"""`digits`: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes, no download)."""
from __future__ import annotations

import numpy as np
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset, hold_out

__all__ = ["digits"]


@datasets.register("digits")
def digits(cfg) -> RawDataset:
    """Images as (1, 8, 8) floats in [0, 1]; `data.test_size` of them are the server's test set."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("data.type: digits needs scikit-learn (pip install 'fedcore[data]' or "
                          "pip install scikit-learn)") from None
    bunch = load_digits()
    x = torch.from_numpy((bunch.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    return hold_out(RawDataset(x, y, 10), cfg["data.test_size"], cfg["seed"])
