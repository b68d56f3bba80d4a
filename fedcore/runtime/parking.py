"""Where a deployed server keeps the global model while a folding round collects: in a file.

A folding round (algorithms/streaming.py) needs of the global model only what it sends at
the round's start; FedAvg replaces it with the round's mean, a server optimizer reads it
once more at the end. Held in memory meanwhile, it is one model of the server's peak beside
the float64 running sum (two more). So a deployed server whose model is at least
`distribute.spool_bytes` writes it, as the round starts, to an unlinked file in
`distribute.spool_dir` (wire/spooled.py `park`) and keeps views of the file's mapping
instead: the broadcast is hashed and framed from those views, a slice at a time, each
slice's pages given back once copied (comm/chunking.py), and the aggregation that ends the
round reads whatever it needs back from the file. The server then holds the running sum and
a constant; the system's page cache holds the parked model, which the kernel may write to
disk and drop under memory pressure (it is clean once written back). Only the entries the
round replaces are parked (those exchanged, `federate.share_params`): one kept across
rounds would keep the whole file. A model that is already parked (a round that changed
nothing) is not written again. Where the file cannot be written (a full disk), that is
said once and the model stays in memory.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fedcore.kernel.server_state import worker_state
from fedcore.wire.spooled import is_mapped, park, release

__all__ = ["Parking", "park_global", "model_bytes", "round_spills", "PARKED_TENSOR_BYTES"]

log = logging.getLogger("fedcore.deploy")

PARKED_TENSOR_BYTES = 2 ** 20   # tensors this large are parked; smaller ones stay in memory


@worker_state("parking")
@dataclass
class Parking:
    """Set by the deployment on its server, or by a simulation (`aggregator.spill`): models of
    `min_bytes` or more (0: never) are parked in `folder` (None: the system's temporary
    folder); with `spill_sum`, a folding round's running sum and a server optimizer's moments
    go there too (a simulation's, algorithms/spill.py `spill_in_simulation`). Nothing to
    save: the deployment or the simulation sets it again when a course resumes."""
    transient = True
    min_bytes: int = 0
    folder: str | None = None
    spill_sum: bool = False
    key: str = "distribute.spool_dir"   # the key a failure names


def model_bytes(state: dict) -> int:
    """The bytes of a model's tensors."""
    return sum(t.numel() * t.element_size() for t in state.values())


def round_spills(server) -> bool:
    """Whether `server`'s folding rounds keep their large models in files beside the global
    model: a simulation's running sum, a server optimizer's moments and a batching executor's
    waiting results (`spill_sum`, algorithms/spill.py), for a model of `min_bytes` or more."""
    parking = server.state(Parking)
    return parking.spill_sum and 0 < parking.min_bytes <= model_bytes(server.aggregator.global_state)


def park_global(server) -> None:
    """Park the server's global model (its large CPU tensors) if the deployment asks for it:
    the aggregator and the server's module then view the file's mapping."""
    parking = server.state(Parking)
    if parking.min_bytes <= 0:
        return
    aggregator = server.aggregator
    state = aggregator.global_state
    if model_bytes(state) < parking.min_bytes:
        return
    # only entries the round replaces (one it keeps, not shared, would hold the whole file),
    # and not those parked already (a round that changed nothing)
    large = {k: t for k, t in state.items() if aggregator.shared(k) and t.device.type == "cpu"
             and t.numel() * t.element_size() >= PARKED_TENSOR_BYTES and not is_mapped(t)}
    for t in state.values():   # parked already (a round that changed nothing, a server optimizer's
        release(t)             # step written to a file): what was read of it since goes back
    if not large:
        return
    try:
        parked = park(large, parking.folder)
    except OSError as exc:
        log.warning("%s: the global model could not be kept in a file (%s); it stays in memory "
                    "while rounds collect", parking.key, exc)
        parking.min_bytes = 0
        return
    aggregator.global_state = {**state, **parked}
    server.course.monitor.tally("parking", "parked_rounds")   # summary.json: models this process parked
    # the module views the global model (handlers/evaluation.py `load_global`): it views the file now
    server.model.load_state_dict(parked, strict=False, assign=True)
