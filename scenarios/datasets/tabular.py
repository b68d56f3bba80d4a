"""`csv`: a table with a header, a label column, an optional client column and numeric features.

Labels are classes (mapped to 0..C-1) unless the course regresses (`train.loss: mse`, which
`trees.objective: reg:squarederror` sets): then they are the numbers in the column, in float64."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset, hold_out

__all__ = ["csv_dataset", "natural_key"]


@datasets.register("csv")
def csv_dataset(cfg) -> RawDataset:
    """Labels are mapped to 0..C-1 in natural order, or kept as numbers for a regression course;
    `data.test_size` of the rows go to the server."""
    root = cfg["data.root"]
    if not root:
        raise ConfigError("data.root: csv data needs data.root=<path to the .csv file>")
    path = Path(root).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"data.root: csv file '{path}' {what}; expected a CSV file with a "
                          f"header row and a '{cfg['data.label_column']}' column")
    label_col, client_col = cfg["data.label_column"], cfg["data.client_column"]
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        for col in filter(None, (label_col, client_col)):
            if col not in header:
                raise ConfigError(f"data.label_column/client_column: column '{col}' not in {path} "
                                  f"(columns: {', '.join(header)})")
        features = [c for c in header if c not in (label_col, client_col)]
        rows = list(reader)
    if not rows:
        raise ConfigError(f"data.root: csv file '{path}' has no rows")
    try:
        x = np.array([[float(r[c]) for c in features] for r in rows], dtype=np.float64)  # cast to model.dtype later
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"data.root: non-numeric or missing feature in '{path}': {exc}") from None
    labels = [r[label_col] for r in rows]
    if cfg["train.loss"] == "mse":
        y, num_classes = _targets(cfg, path, labels), 1
    else:
        classes = sorted(set(labels), key=natural_key)
        index = {c: i for i, c in enumerate(classes)}
        y, num_classes = np.array([index[v] for v in labels], dtype=np.int64), len(classes)
    groups = None
    if client_col:
        names = [r[client_col] for r in rows]
        order = {c: i for i, c in enumerate(sorted(set(names), key=natural_key))}
        groups = np.array([order[v] for v in names])
    raw = RawDataset(torch.from_numpy(x), torch.from_numpy(y), num_classes, groups)
    return hold_out(raw, cfg["data.test_size"], cfg["seed"])


def _targets(cfg, path: Path, labels: list[str]) -> np.ndarray:
    """A regression course's labels: the column's numbers (a partition by class cannot apply)."""
    if cfg["data.partition"] in ("dirichlet", "shards", "dirichlet_groups"):
        raise ConfigError(f"data.partition: {cfg['data.partition']} splits by class and a regression "
                          "course (train.loss: mse) has numeric labels; use data.partition=iid, quantity "
                          "or natural")
    try:
        y = np.array([float(v) for v in labels], dtype=np.float64)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"data.label_column: non-numeric label in '{path}' for a regression course "
                          f"(train.loss: mse): {exc}") from None
    if not np.isfinite(y).all():
        raise ConfigError(f"data.label_column: a label in '{path}' is not a finite number")
    return y


def natural_key(s: str):
    """Sort numbers numerically and before other strings ('2' < '10' < 'a')."""
    try:
        return (0, float(s), s)
    except ValueError:
        return (1, 0.0, s)
