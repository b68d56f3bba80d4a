"""`mnist`, `fashion_mnist`, `emnist`: the IDX files (`*-idx3-ubyte`, `*-idx1-ubyte`, optionally .gz).

IDX: a 4-byte magic (0, 0, dtype code, number of dimensions), one big-endian
uint32 per dimension, then the values row-major in big-endian order.
Images become (1, 28, 28) floats in [0, 1]; the official test files are the
server's test set.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from fedcore.kernel.config import declare
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset, Split
from fedcore.scenarios.datasets.files import (Remote, data_root, ensure, find_file, missing,
                                              open_maybe_gzip, verify)

__all__ = ["read_idx", "mnist", "fashion_mnist", "emnist", "EMNIST_CLASSES"]

declare("data.emnist.split", str, "byclass", "emnist: which EMNIST split to read",
        choices=("byclass", "bymerge", "balanced", "letters", "digits", "mnist"))

_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}

_MNIST_BASE = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_FASHION_BASE = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_MNIST_MD5 = {"train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
              "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
              "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
              "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c"}
_FASHION_MD5 = {"train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
                "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
                "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
                "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}
_EMNIST_ZIP = Remote("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",
                     "58c8d27c78d21e728a6bc7b3cc06412e")


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (plain or gzip) into an array of its declared shape and type."""
    with open_maybe_gzip(Path(path)) as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise ConfigError(f"data.root: '{path}' is not an IDX file (bad magic number)")
    ndim = data[3]
    header = 4 + 4 * ndim
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_DTYPES[data[2]])
    count = int(np.prod(dims)) if dims else 0
    if len(data) - header != count * dtype.itemsize:
        raise ConfigError(f"data.root: '{path}' is truncated or padded: header says {dims}, "
                          f"{len(data) - header} bytes of values follow")
    return np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(dims).astype(
        dtype.newbyteorder("="))


def _pair(root: Path, images: str, labels: str, dataset: str, where: str):
    paths = [find_file(root, images), find_file(root, labels)]
    if None in paths:
        raise missing(dataset, root, [f"{images}[.gz]", f"{labels}[.gz]"], where)
    x, y = read_idx(paths[0]), read_idx(paths[1])
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
        raise ConfigError(f"data.root: {paths[0].name} ({x.shape}) and {paths[1].name} ({y.shape}) "
                          "do not hold matching images and labels")
    return x, y


def _images(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)


def _load(cfg, dataset: str, prefix: str, md5: dict[str, str], base: str, where: str,
          transpose: bool = False, label_offset: int = 0, num_classes: int = 10) -> RawDataset:
    root = data_root(cfg, dataset, where)
    if md5:
        ensure(cfg, [Remote(base + name, digest) for name, digest in md5.items()], root)
    stems = (("train", "train"), ("test", "t10k" if not prefix else "test"))
    names = [f"{prefix}{stem}-{kind}" for _, stem in stems
             for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")]
    if any(find_file(root, n) is None for n in names):
        raise missing(dataset, root, [f"{n}[.gz]" for n in names], where)
    splits = {}
    for part, stem in stems:
        x, y = _pair(root, f"{prefix}{stem}-images-idx3-ubyte", f"{prefix}{stem}-labels-idx1-ubyte",
                     dataset, where)
        if transpose:  # EMNIST stores each image transposed relative to MNIST
            x = np.ascontiguousarray(x.transpose(0, 2, 1))
        splits[part] = (_images(x), torch.from_numpy(y.astype(np.int64) - label_offset))
    (x, y), (tx, ty) = splits["train"], splits["test"]
    top = int(max(y.max(), ty.max())) if len(y) else 0
    if len(y) and (int(min(y.min(), ty.min())) < 0 or top >= num_classes):
        raise ConfigError(f"data.root: {dataset} labels outside 0..{num_classes - 1} in '{root}'")
    return RawDataset(x, y, num_classes, test=Split(tx, ty))


@datasets.register("mnist")
def mnist(cfg) -> RawDataset:
    return _load(cfg, "mnist", "", _MNIST_MD5, _MNIST_BASE,
                 f"get them from {_MNIST_BASE} or http://yann.lecun.com/exdb/mnist/, or set "
                 "data.download=true")


@datasets.register("fashion_mnist")
def fashion_mnist(cfg) -> RawDataset:
    return _load(cfg, "fashion_mnist", "", _FASHION_MD5, _FASHION_BASE,
                 "get them from https://github.com/zalandoresearch/fashion-mnist (data/fashion), "
                 "or set data.download=true")


@datasets.register("emnist")
def emnist(cfg) -> RawDataset:
    split = cfg["data.emnist.split"]
    where = (f"unzip {_EMNIST_ZIP.url} and put the emnist-{split}-* files there, or set "
             "data.download=true")
    root = data_root(cfg, "emnist", where)
    if cfg["data.download"] and find_file(root, f"emnist-{split}-train-images-idx3-ubyte") is None:
        _fetch_emnist(root, split)
    # letters are labelled 1..26 in the published files
    return _load(cfg, "emnist", f"emnist-{split}-", {}, "", where, transpose=True,
                 label_offset=1 if split == "letters" else 0, num_classes=EMNIST_CLASSES[split])


def _fetch_emnist(root: Path, split: str) -> None:
    """Download the EMNIST archive (about 536 MB) and extract one split's four files."""
    from fedcore.scenarios.datasets.files import download
    archive = root / "gzip.zip"
    if archive.is_file():
        verify(archive, _EMNIST_ZIP.md5)
    else:
        download(_EMNIST_ZIP, archive, timeout=600)
    with zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():
            name = member.rsplit("/", 1)[-1]
            if name.startswith(f"emnist-{split}-") and name.endswith(".gz"):
                (root / name).write_bytes(zf.read(member))
    if find_file(root, f"emnist-{split}-train-images-idx3-ubyte") is None:
        raise ConfigError(f"data.download: the EMNIST archive has no files for split '{split}'")
