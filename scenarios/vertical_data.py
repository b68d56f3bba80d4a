"""Vertical data (`data.partition: vertical`): parties hold different columns of the same people.

Party 0 is the active party: it holds the labels and its own columns; parties 1..P-1 are
passive and hold only columns. Every row carries a sample id (a string). Before alignment
each party may hold only some of the ids (`vertical.keep`, or each party's own CSV file), so
the private set intersection (fedcore.algorithms.psi) has work to do; after it every party
keeps the rows of the shared ids in sorted id order, and the same seeded split of those ids
into train and test is drawn by every party.

Interface (stable, also used by tree courses):
  `party_tables(cfg) -> list[PartyTable]`  every party's table before alignment (simulation);
  `party_table(cfg, party) -> PartyTable`  one party's table (a deployed party builds only its own);
  `PartyTable.aligned(ids)`                the rows of `ids`, in that order;
  `train_test_ids(shared, cfg)`            the seeded train/test split of the shared ids.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedcore.kernel.config import declare, resolver, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import components, partitioners

__all__ = ["PartyTable", "party_tables", "party_table", "train_test_ids", "column_groups", "resolve_columns", "standardize", "vertical"]

ACTIVE = 0

declare("vertical.parties", int, 2, "vertical: number of parties P (party 0 is the active party, "
        "holding the labels); at least 2",
        check=lambda v: None if v >= 2 else f"a vertical course needs at least 2 parties, got {v}")
declare("vertical.columns", list, None, "vertical: the columns of each party, one list per party "
        "(names, x<i> or integer indices of the data set's features); default an even split in order "
        "(for images: P vertical strips of the image width)")
declare("vertical.files", list, None, "vertical: one CSV file per party (a header, the id column, "
        "numeric features; party 0's also holds data.label_column); replaces data.type/data.root")
declare("vertical.id_column", str, "id", "vertical: the column holding each row's sample id in "
        "vertical.files")
declare("vertical.standardize", bool, False, "vertical: each party scales its columns to mean 0 and "
        "variance 1 by the statistics of its own aligned training rows (a local step, no message)")
declare("vertical.keep", float, 1.0, "vertical, shipped data sets: the fraction of the sample ids "
        "each party holds (seeded, per party), so that the parties' id sets differ",
        check=lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}")


@dataclass
class PartyTable:
    """One party's rows: sample ids, its feature columns, and (active party only) the labels."""
    party: int
    ids: list[str]
    x: torch.Tensor
    columns: list[str]
    y: torch.Tensor | None
    num_classes: int

    def aligned(self, ids: list[str]) -> "PartyTable":
        """The rows of `ids` in that order (ids the party does not hold raise ConfigError)."""
        where = {s: i for i, s in enumerate(self.ids)}
        missing = [s for s in ids if s not in where]
        if missing:
            raise ConfigError(f"vertical: party {self.party} holds no row with id {missing[0]!r}")
        rows = torch.tensor([where[s] for s in ids], dtype=torch.long)
        return PartyTable(self.party, list(ids), self.x[rows], self.columns,
                          None if self.y is None else self.y[rows], self.num_classes)


def column_groups(names: list[str], parties: int, columns: list | None) -> list[list[int]]:
    """Each party's feature indices: the configured lists (names, x<i> or ints), or an even split."""
    if columns is None:
        if parties > len(names):
            raise ConfigError(f"vertical.parties: {parties} parties but the data has only "
                              f"{len(names)} feature columns")
        return [list(map(int, part)) for part in np.array_split(np.arange(len(names)), parties)]
    if len(columns) != parties:
        raise ConfigError(f"vertical.columns: {len(columns)} column lists for vertical.parties={parties}")
    return [resolve_columns(names, cols, p) for p, cols in enumerate(columns)]


def resolve_columns(names: list[str], cols, party: int) -> list[int]:
    """The indices in `names` of one party's configured columns (names, x<i> or ints)."""
    if not isinstance(cols, list) or not cols:
        raise ConfigError(f"vertical.columns: party {party}'s entry must be a non-empty list of columns")
    index = {n: i for i, n in enumerate(names)}
    index.update({f"x{i}": i for i in range(len(names))})
    idx = []
    for c in cols:
        if isinstance(c, int) and not isinstance(c, bool) and 0 <= c < len(names):
            idx.append(c)
        elif isinstance(c, str) and c in index:
            idx.append(index[c])
        else:
            raise ConfigError(f"vertical.columns: party {party} names column {c!r}, which its data "
                              f"does not have (columns: {', '.join(names)})")
    return idx


def _shipped(cfg) -> list[PartyTable]:
    """A shipped data set (train and test rows pooled, ids '0'..'n-1') split by columns."""
    from fedcore.scenarios.data import raw_dataset
    raw = raw_dataset(cfg)
    x, y = raw.x, raw.y
    if raw.test is not None:
        x, y = torch.cat([x, raw.test.x]), torch.cat([y, raw.test.y])
    if x.is_floating_point():
        x = x.to(getattr(torch, cfg["model.dtype"]))
    n, parties = len(y), cfg["vertical.parties"]
    ids = np.array([str(i) for i in range(n)])
    if x.dim() == 4:   # images: vertical strips of the width
        if cfg["vertical.columns"] is not None:
            raise ConfigError("vertical.columns: image data is split into even strips of the width; "
                              "leave vertical.columns unset")
        groups = column_groups([f"w{i}" for i in range(x.shape[-1])], parties, None)
        slices = [x[..., g[0]:g[-1] + 1] for g in groups]
        names = [[f"w{i}" for i in g] for g in groups]
    else:
        x = x.reshape(n, -1)
        known = _feature_names(cfg, x.shape[1]) or [f"x{i}" for i in range(x.shape[1])]
        groups = column_groups(known, parties, cfg["vertical.columns"])
        slices = [x[:, g] for g in groups]
        names = [[known[i] for i in g] for g in groups]
    tables = []
    for p in range(parties):
        keep = np.arange(n)
        if cfg["vertical.keep"] < 1.0:
            rng = np.random.default_rng([cfg["seed"], 31, p])
            keep = np.sort(rng.choice(n, int(round(cfg["vertical.keep"] * n)), replace=False))
        rows = torch.from_numpy(keep)
        tables.append(PartyTable(p, ids[keep].tolist(), slices[p][rows], names[p],
                                 y[rows] if p == ACTIVE else None, raw.num_classes))
    return tables


def _feature_names(cfg, width: int) -> list[str] | None:
    """Named columns where the data set publishes them (wine), else None (x<i> then)."""
    if cfg["data.type"] == "wine":
        from fedcore.scenarios.datasets.wine import FEATURES
        return list(FEATURES) if len(FEATURES) == width else None
    return None


def _read_csv(cfg, party: int, path: str) -> PartyTable:
    id_col, label_col = cfg["vertical.id_column"], cfg["data.label_column"]
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"vertical.files: party {party}'s file '{file}' does not exist")
    with file.open(newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    need = [id_col] + ([label_col] if party == ACTIVE else [])
    for col in need:
        if col not in header:
            raise ConfigError(f"vertical.files: party {party}'s file '{file}' has no column '{col}' "
                              f"(columns: {', '.join(header)})")
    features = [c for c in header if c not in (id_col, label_col)]
    cols = cfg["vertical.columns"]
    if cols is not None:
        if len(cols) != cfg["vertical.parties"]:
            raise ConfigError(f"vertical.columns: {len(cols)} column lists for "
                              f"vertical.parties={cfg['vertical.parties']}")
        features = [features[i] for i in resolve_columns(features, cols[party], party)]
    ids = [r[id_col] for r in rows]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"vertical.files: party {party}'s file '{file}' repeats a sample id")
    try:
        x = torch.tensor([[float(r[c]) for c in features] for r in rows], dtype=torch.float64)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"vertical.files: non-numeric or missing feature in '{file}': {exc}") from None
    y, classes = None, 0
    if party == ACTIVE:
        from fedcore.scenarios.datasets.tabular import natural_key
        labels = [r[label_col] for r in rows]
        names = sorted(set(labels), key=natural_key)
        index = {c: i for i, c in enumerate(names)}
        y, classes = torch.tensor([index[v] for v in labels], dtype=torch.long), len(names)
    x = x.reshape(len(rows), len(features)).to(getattr(torch, cfg["model.dtype"]))
    return PartyTable(party, ids, x, features, y, classes)


def party_tables(cfg) -> list[PartyTable]:
    """Every party's table before alignment, as each party would build its own."""
    files = cfg["vertical.files"]
    if files is not None:
        if len(files) != cfg["vertical.parties"]:
            raise ConfigError(f"vertical.files: {len(files)} files for vertical.parties="
                              f"{cfg['vertical.parties']}; give one CSV file per party")
        tables = [_read_csv(cfg, p, f) for p, f in enumerate(files)]
        for t in tables:
            t.num_classes = tables[ACTIVE].num_classes
        return tables
    return _shipped(cfg)


def party_table(cfg, party: int) -> PartyTable:
    """Party `party`'s table alone, read from its own file only (a passive party's
    `num_classes` is then 0: the label count is the active party's to tell)."""
    files = cfg["vertical.files"]
    if files is not None:
        if len(files) != cfg["vertical.parties"]:
            raise ConfigError(f"vertical.files: {len(files)} files for vertical.parties="
                              f"{cfg['vertical.parties']}; give one CSV file per party")
        return _read_csv(cfg, party, files[party])
    return _shipped(cfg)[party]


def standardize(train: PartyTable, test: PartyTable) -> None:
    """Scale both tables' columns by the training rows' mean and standard deviation (1 where 0)."""
    if not train.x.is_floating_point() or len(train.ids) == 0:
        return
    mean = train.x.mean(dim=0, keepdim=True)
    std = train.x.std(dim=0, keepdim=True, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    train.x, test.x = (train.x - mean) / std, (test.x - mean) / std


def train_test_ids(shared: list[str], cfg) -> tuple[list[str], list[str]]:
    """The seeded split of the shared ids (sorted) into train and test (`data.test_size`)."""
    ids = sorted(shared)
    perm = np.random.default_rng([cfg["seed"], 37]).permutation(len(ids))
    n_test = int(round(cfg["data.test_size"] * len(ids)))
    return sorted(ids[i] for i in perm[n_test:]), sorted(ids[i] for i in perm[:n_test])


@partitioners.register("vertical")
def vertical(raw, n: int, cfg) -> list[np.ndarray]:
    """Rows are not split in a vertical course; its parties split the columns (party_tables)."""
    raise ConfigError("data.partition: vertical splits columns across parties and runs the "
                      "vertical course; it cannot split rows among horizontal clients")


@resolver
def _vertical_course(values: dict) -> None:
    """`data.partition: vertical` runs the vertical course of `vertical.method`."""
    if values["data.partition"] == "vertical":
        values["course"] = f"vertical_{values['vertical.method']}"


@validator
def _check_vertical(cfg) -> None:
    if cfg["data.partition"] != "vertical":
        return
    if cfg["course"] not in ("vertical_splitnn", "vertical_he_lr"):   # snapshots: those two courses'
        for key in ("resume_from", "checkpoint.every"):
            if cfg[key]:
                raise ConfigError(f"{key}: a {cfg['course']} course does not write or resume snapshots; "
                                  f"unset {key}")
    for key, default in (("asyn.use", False), ("topology.edges", 0), ("executor", "sequential")):
        if cfg[key] != default:
            raise ConfigError(f"{key}: a vertical course runs one synchronous flow; set {key}={default}")
    cols = cfg["vertical.columns"]
    if cols is not None and len(cols) != cfg["vertical.parties"]:
        raise ConfigError(f"vertical.columns: {len(cols)} column lists for "
                          f"vertical.parties={cfg['vertical.parties']}")


components.register("vertical_tables", party_tables)
components.register("vertical_table", party_table)
components.register("vertical_train_test_ids", train_test_ids)
components.register("vertical_standardize", standardize)
