"""Dataset builders, one module per family; each registers under its `data.type` name.

Each builder takes the config and returns a `RawDataset` (all samples as
tensors, natural groups where the data has them, and the server's test set).
"""
from fedcore.scenarios.datasets import cifar, digits, files, idx, leaf, sklearn_tables, synthetic, tabular, wine  # noqa: F401
from fedcore.scenarios.datasets.synthetic import softmax_synthetic, synthetic as synthetic_dataset
from fedcore.scenarios.datasets.tabular import csv_dataset

__all__ = ["cifar", "digits", "files", "idx", "leaf", "sklearn_tables", "synthetic", "tabular", "wine", "softmax_synthetic",
           "synthetic_dataset", "csv_dataset"]
