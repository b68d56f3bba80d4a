"""A client's own random draws: its mini-batch order and its round's random stream.

`BatchStream` draws each epoch's permutation with torch by
default; with `train.shuffle: numpy` it draws it here, so a numpy (or any
other) trainer that walks `NumpyBatchStream` sees exactly the torch trainer's
batches.

The other random draws of a local training - a model's dropout masks, anything
that uses torch's global generator - come from the client's round stream: a
fit runs inside `client_randomness`, which seeds torch's generator from
(seed, client, round) and restores it afterwards. So a client draws the same
numbers whichever executor, process or actor trains it, and whatever trained
before it; the vectorized engine replays the same stream with a generator of
its own (`fedcore.execution.random_layers`).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from fedcore.kernel.config import declare
from fedcore.kernel.hooks import Wrapper

__all__ = ["epoch_seed", "round_seed", "client_randomness", "own_randomness", "numpy_permutation",
           "BatchStream", "NumpyBatchStream"]

declare("train.shuffle", str, "torch", "how each epoch's mini-batch permutation is drawn: torch's "
        "generator, or numpy's (the same batches for trainers of every backend)",
        choices=("torch", "numpy"))


def epoch_seed(seed: int, client_id: int, epoch: int) -> int:
    """The seed of client `client_id`'s permutation in `epoch`."""
    return (seed * 1_000_003 + client_id) * 10_007 + epoch


def round_seed(seed: int, client_id: int, round_: int) -> int:
    """The seed of client `client_id`'s random stream in round `round_` (dropout masks...)."""
    return ((seed * 1_000_033 + client_id) * 100_019 + round_ * 7 + 3) % 2 ** 63


@contextlib.contextmanager
def client_randomness(seed: int, client_id: int, round_: int, device: torch.device | None = None):
    """torch's global generator (and `device`'s, if not the CPU) seeded with the client's
    round stream for the block, and restored after it.

    The CPU's generator (and a CUDA device's) is seeded directly: `torch.manual_seed` also
    seeds every other backend, and where one is not initialised it records a formatted stack
    for later - a quarter of a small model's sequential fit."""
    cuda = device is not None and device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
        stream = round_seed(seed, client_id, round_)
        if device is None or device.type == "cpu":
            torch.default_generator.manual_seed(stream)
        elif cuda:
            torch.default_generator.manual_seed(stream)
            with torch.cuda.device(device):
                torch.cuda.manual_seed(stream)
        else:
            torch.manual_seed(stream)
        yield


def own_randomness(trainer, seed: int) -> None:
    """Make every `trainer.fit` draw from its client's round stream (a wrapper outside every
    behaviour's; it also counts the fits in `trainer.own_fits`). The engines draw the same
    streams themselves, so it applies to a batched result as to a plain fit."""
    trainer.own_fits = 0
    device = getattr(trainer, "device", None)

    def fit_with_own_stream(fit, client_id: int, data, received: dict, round_: int):
        trainer.own_fits += 1
        with client_randomness(seed, client_id, round_, device):
            return fit(client_id, data, received, round_)

    def counted(fit, *args):   # a batched result: the engine drew the client's stream itself
        trainer.own_fits += 1
        return fit(*args)
    trainer.wrap(Wrapper("own randomness", "fit", fit_with_own_stream, per_client_result=True,
                         process_safe=True, around_result=counted))


def numpy_permutation(n: int, seed: int, client_id: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(epoch_seed(seed, client_id, epoch)).permutation(n)


class BatchStream:
    """A client's persistent, seeded mini-batch stream.

    Each epoch is a fresh permutation drawn from `(seed, client, epoch)`; the
    position (epoch, offset) is kept in the client's state, so the stream
    advances across rounds instead of replaying the first batches.
    """

    def __init__(self, n: int, batch_size: int, seed: int, client_id: int,
                 epoch: int = 0, offset: int = 0, shuffle: str = "torch"):
        self.n, self.batch_size = n, batch_size
        self.seed, self.client_id = seed, client_id
        self.epoch, self.offset = epoch, offset
        self.shuffle = shuffle   # train.shuffle: whose generator draws the permutations
        self._perm = self._permutation(epoch)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self.shuffle == "numpy":
            return torch.from_numpy(numpy_permutation(self.n, self.seed, self.client_id, epoch))
        g = torch.Generator().manual_seed(self.epoch_seed(self.seed, self.client_id, epoch))
        return torch.randperm(self.n, generator=g)

    epoch_seed = staticmethod(epoch_seed)

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def next(self) -> torch.Tensor:
        if self.offset >= self.n:
            self.epoch += 1
            self.offset = 0
            self._perm = self._permutation(self.epoch)
        idx = self._perm[self.offset:self.offset + self.batch_size]
        self.offset += len(idx)
        return idx

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}


class NumpyBatchStream(BatchStream):
    """`BatchStream` with `train.shuffle: numpy`, yielding numpy index arrays (same position
    format, so a client's stored position means the same in both)."""

    def __init__(self, n: int, batch_size: int, seed: int, client_id: int,
                 epoch: int = 0, offset: int = 0):
        super().__init__(n, batch_size, seed, client_id, epoch, offset, shuffle="numpy")

    def _permutation(self, epoch: int) -> np.ndarray:
        return numpy_permutation(self.n, self.seed, self.client_id, epoch)
