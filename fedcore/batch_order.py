"""A client's mini-batch order, in numpy: the same batches for trainers of any backend.

`BatchStream` (fedcore.contract) draws each epoch's permutation with torch by
default; with `train.shuffle: numpy` it draws it here, so a numpy (or any
other) trainer that walks `NumpyBatchStream` sees exactly the torch trainer's
batches. Imports numpy only.
"""
from __future__ import annotations

import math

import numpy as np

from fedcore.config import declare

__all__ = ["epoch_seed", "numpy_permutation", "NumpyBatchStream"]

declare("train.shuffle", str, "torch", "how each epoch's mini-batch permutation is drawn: torch's "
        "generator, or numpy's (the same batches for trainers of every backend)",
        choices=("torch", "numpy"))


def epoch_seed(seed: int, client_id: int, epoch: int) -> int:
    """The seed of client `client_id`'s permutation in `epoch`."""
    return (seed * 1_000_003 + client_id) * 10_007 + epoch


def numpy_permutation(n: int, seed: int, client_id: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(epoch_seed(seed, client_id, epoch)).permutation(n)


class NumpyBatchStream:
    """`BatchStream` with `train.shuffle: numpy`, yielding numpy index arrays (same position
    format, so a client's stored position means the same in both)."""

    def __init__(self, n: int, batch_size: int, seed: int, client_id: int,
                 epoch: int = 0, offset: int = 0):
        self.n, self.batch_size = n, batch_size
        self.seed, self.client_id = seed, client_id
        self.epoch, self.offset = epoch, offset
        self._perm = numpy_permutation(n, seed, client_id, epoch)

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def next(self) -> np.ndarray:
        if self.offset >= self.n:
            self.epoch += 1
            self.offset = 0
            self._perm = numpy_permutation(self.n, self.seed, self.client_id, self.epoch)
        idx = self._perm[self.offset:self.offset + self.batch_size]
        self.offset += len(idx)
        return idx

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}
