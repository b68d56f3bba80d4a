"""`cifar10` / `cifar100`: the binary version (fixed-length records), never the pickled one.

CIFAR-10 record: 1 label byte, then 3,072 pixel bytes (1,024 red, 1,024
green, 1,024 blue, each 32x32 row-major). CIFAR-100 records carry two label
bytes (coarse, then fine) before the pixels. Images become (3, 32, 32)
floats in [0, 1]; the test file is the server's test set.
"""
from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import torch

from fedcore.kernel.config import declare
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset, Split
from fedcore.scenarios.datasets.files import Remote, data_root, download, verify

__all__ = ["read_cifar_records", "cifar10", "cifar100"]

declare("data.cifar100.labels", str, "fine", "cifar100: the 100 fine classes or the 20 coarse "
        "superclasses", choices=("fine", "coarse"))

_PIXELS = 3 * 32 * 32
_SPECS = {  # folder inside the archive, train files, test file, label bytes, archive
    "cifar10": ("cifar-10-batches-bin", [f"data_batch_{i}.bin" for i in range(1, 6)], "test_batch.bin", 1,
                Remote("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
                       "c32a1d4ab5d03f1284b67883e8d87530")),
    "cifar100": ("cifar-100-binary", ["train.bin"], "test.bin", 2,
                 Remote("https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
                        "03b5dce01913d631647c71ecec9e9cb8")),
}


def read_cifar_records(path: Path, label_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(images N x 3 x 32 x 32 uint8, labels N x label_bytes uint8) from one binary file."""
    raw = np.fromfile(path, dtype=np.uint8)
    size = label_bytes + _PIXELS
    if raw.size == 0 or raw.size % size:
        raise ConfigError(f"data.root: '{path}' is not a CIFAR binary file ({raw.size} bytes is not "
                          f"a multiple of the {size}-byte record)")
    records = raw.reshape(-1, size)
    return records[:, label_bytes:].reshape(-1, 3, 32, 32), records[:, :label_bytes]


def _folder(root: Path, inner: str, needed: list[str]) -> Path | None:
    for folder in (root, root / inner):
        if all((folder / name).is_file() for name in needed):
            return folder
    return None


def _extract(archive: Path, root: Path, inner: str, needed: list[str]) -> None:
    """Extract only the expected regular files, never arbitrary member paths."""
    (root / inner).mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name.rsplit("/", 1)[-1]
            if member.isfile() and name in needed:
                src = tar.extractfile(member)
                (root / inner / name).write_bytes(src.read())


def _load(cfg, dataset: str, label_index: int, num_classes: int) -> RawDataset:
    inner, train_files, test_file, label_bytes, remote = _SPECS[dataset]
    needed = train_files + [test_file]
    where = (f"get {remote.url} (binary version) and extract it, or set data.download=true")
    root = data_root(cfg, dataset, where)
    folder = _folder(root, inner, needed)
    if folder is None and cfg["data.download"]:
        archive = root / remote.name
        if archive.is_file():
            verify(archive, remote.md5)
        else:
            download(remote, archive, timeout=600)
        _extract(archive, root, inner, needed)
        folder = _folder(root, inner, needed)
    if folder is None:
        shown = [f"{inner}/{n}" for n in needed]
        raise ConfigError(f"data.root: {dataset} files not found in '{root}': expected "
                          f"{', '.join(shown[:2])}, ... {shown[-1]}; {where}")
    parts = [read_cifar_records(folder / name, label_bytes) for name in needed]
    x = np.concatenate([p[0] for p in parts[:-1]])
    y = np.concatenate([p[1][:, label_index] for p in parts[:-1]])
    tx, ty = parts[-1][0], parts[-1][1][:, label_index]
    if max(int(y.max()), int(ty.max())) >= num_classes:
        raise ConfigError(f"data.root: {dataset} labels outside 0..{num_classes - 1} in '{folder}'")

    def tensors(a, b):
        return torch.from_numpy(a.astype(np.float32) / 255.0), torch.from_numpy(b.astype(np.int64))
    return RawDataset(*tensors(x, y), num_classes, test=Split(*tensors(tx, ty)))


@datasets.register("cifar10")
def cifar10(cfg) -> RawDataset:
    return _load(cfg, "cifar10", 0, 10)


@datasets.register("cifar100")
def cifar100(cfg) -> RawDataset:
    fine = cfg["data.cifar100.labels"] == "fine"
    return _load(cfg, "cifar100", 1 if fine else 0, 100 if fine else 20)
