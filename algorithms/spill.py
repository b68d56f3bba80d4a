"""A simulation's large model kept out of its memory while its clients train (`aggregator.spill`).

A folding round (algorithms/streaming.py) needs of the server, while a client trains, nothing
but the running sum a slice at a time; the global model is read once per client into the
trainer's working copy. So a simulation whose model is large parks the global model in a file
as a round starts (runtime/parking.py, as a deployed server does), keeps the round's float64
sum and writes its mean in files (`RunningMean(spill=True)`), and has a server optimizer write
its step and moments into files band by band: each is an unlinked file (no name, owner-only,
gone with its last view) in the run's outdir, mapped, its pages given back once read or
written (wire/spooled.py). The process then holds the trainer's working copy and its
gradients, or the update being folded: about two models, whatever the clients per round.
The arithmetic is the same on the same values, so the results are those of the rounds held
in memory bit for bit. Per client it costs reading the model once (into the working copy)
and reading and writing the float64 sum once (four model sizes more), through the system's
page cache, which the kernel writes back to the disk and may drop under memory pressure.
"""
from __future__ import annotations

import ctypes
import logging

import torch

from fedcore.algorithms.streaming import _model_bytes
from fedcore.kernel.config import declare
from fedcore.runtime.parking import PARKED_TENSOR_BYTES, Parking, round_spills
from fedcore.wire.spooled import blank

__all__ = ["spill_in_simulation", "SPILL_AUTO_BYTES"]

log = logging.getLogger("fedcore.course")

SPILL_AUTO_BYTES = 64 * 2 ** 20   # `aggregator.spill: auto` spills models at least this large

declare("aggregator.spill", str, "auto", "a simulation whose rounds fold (aggregator.streaming) "
        "keeps, while its clients train, the global model, the float64 running sum and a server "
        "optimizer's moments in unlinked private files in the run's outdir (the system's temporary "
        "folder without one), not in memory; each client reads the model from there and folds its "
        "update into the sum there, a slice at a time (per client: the model read once, the sum "
        "read and written once): on, off, or auto (models of 64 MiB or more)",
        choices=("auto", "on", "off"))


def spill_in_simulation(server) -> None:
    """`aggregator.spill`: a simulation's folding rounds park the global model
    (runtime/parking.py) and keep their running sum, and a server optimizer its moments, in
    files (wire/spooled.py `blank`), so that the process holds, while a client trains, little
    more than the trainer's working copy and its gradients. The same arithmetic on the same
    values: the results are those of the rounds held in memory, bit for bit."""
    mode = server.course.cfg["aggregator.spill"]
    if mode == "off" or (mode == "auto" and _model_bytes(server.aggregator) < SPILL_AUTO_BYTES):
        return
    parking = server.state(Parking)
    outdir = getattr(server.course, "outdir", None)
    parking.min_bytes = 1
    parking.folder = None if outdir is None else str(outdir)
    parking.spill_sum = True
    parking.key = "aggregator.spill"
    opt = getattr(server.aggregator, "server_optimizer", None)
    if opt is not None:
        opt.allocate = lambda like: _spilled_like(server, like)
    # an algorithm's own model-sized state (SCAFFOLD's c, c_i, c - c_i and its update's halves)
    for part in (server.aggregator, getattr(server.course, "trainer", None)):
        if hasattr(part, "spill_into"):
            part.spill_into(parking.folder)
    _map_large_allocations()


MMAP_THRESHOLD = 2 ** 20   # bytes from which glibc maps an allocation on its own (`_map_large_allocations`)


def _map_large_allocations() -> None:
    """Ask glibc (where it is the C library) to map each allocation of MMAP_THRESHOLD bytes
    or more on its own, and unmap it when freed: a large model's training makes transient
    tensors (activations, their gradients) of a few MiB, which glibc's adaptive threshold
    would otherwise keep in its heap once freed, fragmented, a heap that grew by a model's
    size over a round's clients. Costs a page fault per page of each such tensor."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, MMAP_THRESHOLD)   # M_MMAP_THRESHOLD (fixes it: no adaptive threshold)
    except (OSError, AttributeError):     # not glibc: its own policy
        pass


def _spilled_like(server, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor like `like`: in a file where the round spills (see
    `spill_in_simulation`), else in memory."""
    parking = server.state(Parking)
    if (like.device.type == "cpu" and like.numel() * like.element_size() >= PARKED_TENSOR_BYTES
            and round_spills(server)):
        try:
            return blank({"t": (tuple(like.shape), like.dtype)}, parking.folder)["t"]
        except OSError as exc:
            log.warning("aggregator.spill: a server optimizer's step could not be kept in a file in %s "
                        "(%s); it is kept in memory from now on", parking.folder or "the temporary folder", exc)
            server.aggregator.server_optimizer.allocate = torch.empty_like
    return torch.empty_like(like)
