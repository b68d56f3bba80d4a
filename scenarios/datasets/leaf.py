"""`leaf_femnist`, `leaf_shakespeare`, `leaf_synthetic`: LEAF's JSON files, one client per user.

Each LEAF file holds `users` (ids), `num_samples` (counts) and `user_data`
(per user `{"x": [...], "y": [...]}`). `data.root` is the dataset's `data`
folder: `train/*.json` (or, without a train/ folder, the *.json files in the
root itself, e.g. `all_data/`) and optionally `test/*.json`. Users keep
their natural partition (`groups`); the test files' samples, pooled over
users, are the server's test set.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset, Split, hold_out
from fedcore.scenarios.datasets.files import data_root

__all__ = ["read_leaf", "LEAF_LETTERS", "encode_text", "leaf_femnist", "leaf_shakespeare",
           "leaf_synthetic"]

# LEAF's Shakespeare vocabulary (80 symbols); any other character maps to the space.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_INDEX = {c: i for i, c in enumerate(LEAF_LETTERS)}
_WHERE = ("generate them with LEAF's preprocess.sh (https://github.com/TalwalkarLab/leaf, "
          "data/<name>/data/{train,test}/*.json); LEAF data has no direct download")


def encode_text(text: str) -> list[int]:
    """Characters to LEAF vocabulary indices."""
    space = _INDEX[" "]
    return [_INDEX.get(c, space) for c in text]


def read_leaf(files: list[Path]) -> dict[str, dict]:
    """user id -> {"x": [...], "y": [...]}, merged over files, users in order of appearance."""
    users: dict[str, dict] = {}
    for path in files:
        try:
            doc = json.loads(path.read_text())
            ids, data = doc["users"], doc["user_data"]
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"data.root: '{path}' is not valid JSON ({exc})") from None
        except (KeyError, TypeError):
            raise ConfigError(f"data.root: '{path}' is not a LEAF file (needs 'users' and "
                              "'user_data')") from None
        counts = doc.get("num_samples", [len(data[u]["y"]) for u in ids])
        for uid, count in zip(ids, counts):
            block = data[uid]
            if len(block["x"]) != len(block["y"]) or len(block["y"]) != count:
                raise ConfigError(f"data.root: '{path}' user '{uid}': num_samples {count} but "
                                  f"{len(block['x'])} x and {len(block['y'])} y")
            merged = users.setdefault(uid, {"x": [], "y": []})
            merged["x"].extend(block["x"])
            merged["y"].extend(block["y"])
    return users


def _files(cfg, dataset: str) -> tuple[list[Path], list[Path]]:
    root = data_root(cfg, dataset, _WHERE)
    if not (root / "train").is_dir() and (root / "data" / "train").is_dir():
        root = root / "data"  # pointed at LEAF's data/<name> instead of data/<name>/data
    train_dir = root / "train" if (root / "train").is_dir() else root
    train = sorted(train_dir.glob("*.json"))
    test = sorted((root / "test").glob("*.json")) if (root / "test").is_dir() else []
    if not train:
        raise ConfigError(f"data.root: {dataset} files not found in '{root}': expected train/*.json "
                          f"(LEAF JSON with users, num_samples, user_data); {_WHERE}")
    return train, test


def _load(cfg, dataset: str, encode_x, encode_y, num_classes: int | None) -> RawDataset:
    train_files, test_files = _files(cfg, dataset)
    users = read_leaf(train_files)
    xs, ys, groups = [], [], []
    for k, block in enumerate(users.values()):
        xs.extend(block["x"])
        ys.extend(block["y"])
        groups.extend([k] * len(block["y"]))
    if not ys:
        raise ConfigError(f"data.root: {dataset} training files hold no samples")
    x, y = encode_x(xs), encode_y(ys)
    test = None
    if test_files:
        pooled = [(a, b) for block in read_leaf(test_files).values() for a, b in zip(block["x"], block["y"])]
        if pooled:
            test = Split(encode_x([a for a, _ in pooled]), encode_y([b for _, b in pooled]))
    if num_classes is None:
        num_classes = int(max(y.max(), test.y.max() if test is not None else 0)) + 1
    raw = RawDataset(x, y, num_classes, np.array(groups), test)
    return raw if test is not None else hold_out(raw, cfg["data.test_size"], cfg["seed"])


def _floats(dataset: str, shape):
    size = int(np.prod(shape))

    def encode(rows):
        try:
            a = np.asarray(rows, dtype=np.float32)
            if a.ndim != 2 or a.shape[1] != size:
                raise ValueError
        except ValueError:
            raise ConfigError(f"data.root: {dataset} samples must each be {size} numbers") from None
        return torch.from_numpy(a).reshape(-1, *shape)
    return encode


def _labels(rows) -> torch.Tensor:
    return torch.tensor(np.asarray(rows, dtype=np.int64))


@datasets.register("leaf_femnist")
def leaf_femnist(cfg) -> RawDataset:
    """62 classes (digits, upper- and lower-case letters); x is 784 floats -> (1, 28, 28)."""
    return _load(cfg, "leaf_femnist", _floats("leaf_femnist", (1, 28, 28)), _labels, 62)


@datasets.register("leaf_shakespeare")
def leaf_shakespeare(cfg) -> RawDataset:
    """Next-character prediction: x an 80-character string, y the next character (80 symbols)."""
    def encode_x(rows):
        if len({len(s) for s in rows}) > 1 or any(not isinstance(s, str) for s in rows):
            raise ConfigError("data.root: leaf_shakespeare samples must be strings of one length (80)")
        return torch.tensor([encode_text(s) for s in rows], dtype=torch.long)

    def encode_y(rows):
        if any(not isinstance(c, str) or len(c) != 1 for c in rows):
            raise ConfigError("data.root: leaf_shakespeare labels must be single characters")
        return torch.tensor([encode_text(c)[0] for c in rows], dtype=torch.long)
    return _load(cfg, "leaf_shakespeare", encode_x, encode_y, len(LEAF_LETTERS))


@datasets.register("leaf_synthetic")
def leaf_synthetic(cfg) -> RawDataset:
    """LEAF's synthetic data: x a feature vector, y an integer class (classes from the labels)."""
    def encode_x(rows):
        try:
            a = np.asarray(rows, dtype=np.float32)
        except ValueError:
            a = np.zeros(0)
        if a.ndim != 2:
            raise ConfigError("data.root: leaf_synthetic samples must be feature vectors of one length")
        return torch.from_numpy(a)
    return _load(cfg, "leaf_synthetic", encode_x, _labels, None)
