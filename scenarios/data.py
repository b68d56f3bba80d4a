"""Federated data: per-client train/val/test tensors and the server's test set.

A dataset builder returns one `RawDataset` (all samples as tensors, with
optional natural groups and an official test set); a partitioner splits its
indices among clients; each client's share is split train/val/test with the
run's seed. Tensors are materialised once and sliced by index: no
per-sample Dataset objects on the hot path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedcore.kernel import registry
from fedcore.kernel.errors import ConfigError

__all__ = ["Split", "ClientData", "RawDataset", "FederatedData", "build_federated_data",
           "build_server_data", "build_client_data", "hold_out", "raw_dataset", "partition_indices"]


@dataclass
class Split:
    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class ClientData:
    train: Split
    val: Split
    test: Split


@dataclass
class RawDataset:
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    groups: np.ndarray | None = None        # natural client of each sample (writers, users, ...)
    test: Split | None = None               # an official held-out test set, if the dataset has one

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


@dataclass
class FederatedData:
    clients: dict[int, ClientData]          # client ids 1..N
    server_test: Split
    input_shape: tuple[int, ...]
    num_classes: int


def hold_out(raw: RawDataset, fraction: float, seed: int) -> RawDataset:
    """Move a seeded random `fraction` of the samples into `raw.test` (datasets without a test set).

    Used by datasets that publish no test split, so the server still evaluates
    on samples no client trains on.
    """
    n = len(raw.y)
    n_test = int(round(fraction * n))
    if raw.test is not None or n_test == 0:
        return raw
    perm = np.random.default_rng(seed + 23).permutation(n)
    te, tr = torch.from_numpy(np.sort(perm[:n_test])), torch.from_numpy(np.sort(perm[n_test:]))
    groups = raw.groups[tr.numpy()] if raw.groups is not None else None
    return RawDataset(raw.x[tr], raw.y[tr], raw.num_classes, groups, Split(raw.x[te], raw.y[te]))


def raw_dataset(cfg) -> RawDataset:
    """The configured dataset, loaded but not yet partitioned."""
    return registry.datasets.get(cfg["data.type"])(cfg)


def partition_indices(cfg, raw: RawDataset) -> list[np.ndarray]:
    """The configured partitioner's index arrays, one per client, checked for count."""
    n_clients = cfg["federate.client_num"]
    parts = registry.partitioners.get(cfg["data.partition"])(raw, n_clients, cfg)
    if len(parts) != n_clients:
        raise ConfigError(f"data.partition: {cfg['data.partition']} produced {len(parts)} clients, "
                          f"federate.client_num is {n_clients}")
    return parts


def _split_indices(idx: np.ndarray, fractions, rng: np.random.Generator):
    idx = rng.permutation(idx)
    n = len(idx)
    n_train = int(round(fractions[0] * n))
    n_val = int(round(fractions[1] * n))
    if fractions[0] > 0 and n > 0 and n_train == 0:
        n_train = 1
    return idx[:n_train], idx[n_train:n_train + n_val], idx[n_train + n_val:]


def _cast(cfg, raw: RawDataset) -> RawDataset:
    """`raw` with its features (and, for an MSE loss, its targets) in the model's dtype."""
    dtype = getattr(torch, cfg["model.dtype"])
    if raw.x.is_floating_point():
        raw.x = raw.x.to(dtype)
    if cfg["train.loss"] == "mse":
        raw.y = raw.y.to(dtype)
        if raw.test is not None:
            raw.test.y = raw.test.y.to(dtype)
    if raw.test is not None and raw.test.x.is_floating_point():
        raw.test.x = raw.test.x.to(dtype)
    return raw


def _client_indices(cfg, raw: RawDataset) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each client's sorted (train, val, test) sample indices, drawn with the run's seed: every
    process of a course (simulation, server, each client) draws the same ones."""
    parts = partition_indices(cfg, raw)
    rng = np.random.default_rng(cfg["seed"] + 17)
    out = []
    for idx in parts:
        splits = _split_indices(np.asarray(idx, dtype=np.int64), cfg["data.splits"], rng)
        out.append(tuple(torch.from_numpy(np.sort(a)) for a in splits))
    return out


def _server_test(raw: RawDataset, indices) -> Split:
    """The official test set, or else the union of the clients' test splits."""
    if raw.test is not None:
        return raw.test
    all_te = torch.cat([te for _, _, te in indices]) if indices else torch.empty(0, dtype=torch.long)
    return Split(raw.x[all_te], raw.y[all_te])


def _slice(raw: RawDataset, splits) -> ClientData:
    return ClientData(*(Split(raw.x[i], raw.y[i]) for i in splits))


@registry.components.register("federated_data")
def build_federated_data(cfg, raw: RawDataset | None = None) -> FederatedData:
    """Build, partition and split the configured dataset, cast to the model's dtype."""
    raw = _cast(cfg, raw if raw is not None else raw_dataset(cfg))
    indices = _client_indices(cfg, raw)
    clients = {cid: _slice(raw, splits) for cid, splits in enumerate(indices, start=1)}
    return FederatedData(clients, _server_test(raw, indices), raw.input_shape, raw.num_classes)


@registry.components.register("federated_data_from_splits")
def federated_data_from_splits(clients: dict, test: tuple, input_shape, num_classes: int
                               ) -> FederatedData:
    """A FederatedData from its tensors: {client: (train, val, test)} with each split an (x, y)
    pair (how a worker process receives a course's data)."""
    return FederatedData({int(cid): ClientData(*(Split(*s) for s in splits))
                          for cid, splits in clients.items()},
                         Split(*test), tuple(input_shape), int(num_classes))


@registry.components.register("server_data")
def build_server_data(cfg) -> tuple[FederatedData, dict[int, int]]:
    """What a deployed server (or edge) holds: no client partitions, the server's test set, and
    each client's number of training samples (its default cap on what a client may declare),
    counted from the partition's indices without slicing any client's samples."""
    raw = _cast(cfg, raw_dataset(cfg))
    indices = _client_indices(cfg, raw)
    sizes = {cid: len(tr) for cid, (tr, _, _) in enumerate(indices, start=1)}
    return FederatedData({}, _server_test(raw, indices), raw.input_shape, raw.num_classes), sizes


@registry.components.register("client_data")
def build_client_data(cfg, client_id: int) -> FederatedData:
    """What deployed client `client_id` holds: its own partition, exactly as the simulation
    builds it, and an empty server test set."""
    raw = _cast(cfg, raw_dataset(cfg))
    indices = _client_indices(cfg, raw)
    empty = Split(raw.x[:0], raw.y[:0])
    return FederatedData({client_id: _slice(raw, indices[client_id - 1])}, empty, raw.input_shape,
                         raw.num_classes)
