"""Partitioners: every sample once, seeded, and the skew each one promises."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.scenarios.data import RawDataset, partition_indices
from fedcore.scenarios.describe import label_entropy
from fedcore.scenarios.partition import allocate_sizes
from tests.conftest import small_cfg


def labelled(n_per_class: int = 60, classes: int = 10) -> RawDataset:
    y = torch.arange(classes).repeat_interleave(n_per_class)
    return RawDataset(torch.zeros(len(y), 2), y, classes, groups=np.arange(len(y)) % 7)


def parts_for(partition: str, raw: RawDataset | None = None, n: int = 10, **over):
    raw = raw if raw is not None else labelled()
    cfg = small_cfg(data__partition=partition, federate__client_num=n, **over)
    return raw, partition_indices(cfg, raw)


def histograms(raw, parts):
    return np.stack([np.bincount(raw.y.numpy()[p], minlength=raw.num_classes) for p in parts])


@pytest.mark.parametrize("partition,over", [
    ("iid", {}), ("dirichlet", {"data__alpha": 0.3}), ("shards", {"data__shards_per_client": 3}),
    ("quantity", {}), ("quantity", {"data__quantity__dist": "powerlaw"}), ("natural", {}),
])
def test_every_sample_exactly_once_and_seeded(partition, over):
    n = 7 if partition == "natural" else 10
    raw, parts = parts_for(partition, n=n, **over)
    assert len(parts) == n
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(raw.y)))
    _, again = parts_for(partition, n=n, **over)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    if partition != "natural":
        _, other = parts_for(partition, n=n, seed=5, **over)
        assert any(not np.array_equal(a, b) for a, b in zip(parts, other))


def test_dirichlet_label_entropy_falls_with_alpha():
    means = []
    for alpha in (100.0, 1.0, 0.1):
        raw, parts = parts_for("dirichlet", n=10, data__alpha=alpha, data__min_size=0)
        means.append(float(label_entropy(histograms(raw, parts)).mean()))
    assert means[0] > means[1] > means[2]
    assert means[0] > 0.9 * np.log(10)  # near uniform labels for large alpha


def test_dirichlet_min_size_holds_and_impossible_min_size_is_a_config_error():
    raw, parts = parts_for("dirichlet", n=20, data__alpha=0.1, data__min_size=10)
    assert min(len(p) for p in parts) >= 10
    with pytest.raises(ConfigError, match="data.min_size"):
        parts_for("dirichlet", n=20, data__min_size=31)


@pytest.mark.parametrize("n,k", [(10, 2), (7, 3), (5, 2), (20, 1)])
def test_shards_give_each_client_exactly_k_labels(n, k):
    raw, parts = parts_for("shards", n=n, data__shards_per_client=k)
    hist = histograms(raw, parts)
    assert ((hist > 0).sum(axis=1) == k).all()
    assert ((hist > 0).sum(axis=0) >= 1).all()  # no label is dropped


def test_shards_split_each_label_evenly_among_its_holders():
    raw, parts = parts_for("shards", n=10, data__shards_per_client=2)  # each label held by 2 clients
    hist = histograms(raw, parts)
    assert sorted(hist[hist > 0].tolist()) == [30] * 20


def test_shards_reject_impossible_settings():
    with pytest.raises(ConfigError, match="exceeds the 10 labels"):
        parts_for("shards", n=10, data__shards_per_client=11)
    with pytest.raises(ConfigError, match="cannot cover"):
        parts_for("shards", n=3, data__shards_per_client=2)


def test_allocate_sizes_by_hand():
    # spare 10 - 3*2 = 4 split 1:1:2 -> 1, 1, 2 plus the minimum 2 each
    assert allocate_sizes(np.array([1.0, 1.0, 2.0]), 10, 2).tolist() == [3, 3, 4]
    # shares 7 * (0.5, 0.3, 0.2) = 3.5, 2.1, 1.4 -> floors 3, 2, 1, one left for the largest fraction
    assert allocate_sizes(np.array([5.0, 3.0, 2.0]), 7, 0).tolist() == [4, 2, 1]
    with pytest.raises(ConfigError):
        allocate_sizes(np.ones(4), 7, 2)


def test_quantity_sizes_are_skewed_with_labels_mixed():
    raw, parts = parts_for("quantity", n=10, data__quantity__sigma=2.0, data__min_size=5)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 5 and sizes.max() > 3 * np.median(sizes)
    raw, flat = parts_for("quantity", n=10, data__quantity__sigma=0.0)
    assert [len(p) for p in flat] == [60] * 10


def test_natural_uses_groups_and_needs_enough_of_them():
    raw, parts = parts_for("natural", n=7)
    assert all((raw.groups[p] == g).all() for g, p in enumerate(parts))
    with pytest.raises(ConfigError, match="only 7"):
        parts_for("natural", n=8)
