"""A batching front for the trainer: many clients' local trainings computed together.

`BatchingTrainer` stands where `course.trainer` was and forwards everything
to the real trainer except `fit`. It watches the communicator: when one
`models` message goes to several clients, it records the receivers that will
actually get it. At the first of those deliveries it asks its engine to
train all of them at once; each later delivery picks up its own, already
computed, result. Client states are saved only when a client's result is
picked up, so a receiver that never gets its delivery keeps its state.

The engines read what the behaviours' wrappers of `fit` declare (`fedcore.kernel.hooks`): the
vectorized engine computes the plain fit and the front runs the wrappers around each
client's result; worker processes and Ray actors run the whole `fit`, wrappers included.
A model sent to one client alone is trained as usual. A batched result is
used only if nothing else trained that client in between (a per-client
count of fits guards this); otherwise, and whenever the engine cannot
handle a client, the real trainer's `fit` runs as usual. Handlers,
virtual timestamps and byte counts are the same as with the sequential
executor.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from fedcore.kernel import registry
from fedcore.kernel.config import declare, positive
from fedcore.kernel.contract import FitResult
from fedcore.kernel.hooks import around_result
from fedcore.kernel.message import SERVER_ID, Message
from fedcore.runtime.parking import PARKED_TENSOR_BYTES, Parking, round_spills
from fedcore.wire.spooled import is_mapped, park

__all__ = ["BatchingTrainer", "Engine", "spilling", "park_waiting"]

log = logging.getLogger("fedcore.executor")

BATCHED_TYPES = ("models",)


class Engine:
    """Trains a batch of clients; `None` in the output means 'run this one sequentially'."""

    name = "engine"
    # True: its results come from the trainer's whole `fit`, wrappers included (workers run
    # the chain); False: from the plain fit, and the front runs the chain around each
    runs_wrappers = False
    # True: a job's state is given as a function that loads it, called as the job is sent, so a
    # batch's client states (SCAFFOLD's c_i, each a model) are not all loaded at once
    loads_states = False

    def fit_many(self, trainer, jobs: list[tuple[int, Any, dict]], received: dict,
                 round_: int) -> list[tuple[FitResult, dict] | None]:
        raise NotImplementedError

    def close(self) -> None:
        """Release processes or other resources."""

    def summary(self) -> dict:
        """Fields the engine adds to the run's summary."""
        return {}


declare("executor.batch_clients", int, None,
        "vectorized, processes and ray executors: the most clients of one broadcast trained "
        "together (null: all its receivers at once); each batch's results wait for their "
        "deliveries, each a model, and are folded as their clients send them "
        "(aggregator.streaming), so this bounds a round's memory for a large model",
        nullable=True, check=positive)


def spilling(course) -> tuple[bool, str | None]:
    """Whether a simulation's rounds keep their large models in files (`aggregator.spill`,
    runtime/parking.py), and the folder: a result waiting for its delivery then waits there."""
    server = getattr(course, "server", None)
    if server is None:
        return False, None
    return round_spills(server), server.state(Parking).folder


def park_waiting(result: FitResult, folder: str | None) -> bool:
    """Move `result`'s large CPU tensors (not in a file yet) into one unlinked file in `folder`
    (wire/spooled.py `park`), in place: a batch's results wait for their deliveries in the
    system's page cache, not in the process, until the fold reads them a slice at a time.
    The same values; where the file cannot be made they stay in memory (False, said)."""
    found: list[tuple[dict, Any]] = []

    def walk(d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif (isinstance(v, torch.Tensor) and v.device.type == "cpu" and not is_mapped(v)
                  and v.numel() * v.element_size() >= PARKED_TENSOR_BYTES):
                found.append((d, k))
    walk(result.content)
    if not found:
        return True
    try:
        parked = park({i: d[k] for i, (d, k) in enumerate(found)}, folder)
    except OSError as exc:
        log.warning("aggregator.spill: a waiting result could not be kept in a file in %s (%s); "
                    "the course's waiting results stay in memory", folder or "the temporary folder", exc)
        return False
    for i, (d, k) in enumerate(found):
        d[k] = parked[i]
    return True


@dataclass
class _Batch:
    content: Any                                   # kept alive, so its id cannot be reused
    round: int
    waiting: dict[int, None] = field(default_factory=dict)   # receivers, in order (O(1) removal)
    computed: bool = False                         # every receiver trained (or tried)
    tried: set[int] = field(default_factory=set)   # receivers a batch trained so far


@dataclass
class _Ready:
    result: FitResult
    state: dict
    version: int


class BatchingTrainer:
    """The real trainer behind a front that batches the fits of one broadcast."""

    def __init__(self, course, trainer, engine: Engine):
        self._course = course
        self._trainer = trainer
        self._engine = engine
        self._batches: dict[int, _Batch] = {}       # id(content) -> batch
        self._latest: dict[int, int] = {}           # client -> id(content) of its newest batch
        self._ready: dict[tuple[int, int], _Ready] = {}
        self._fits: dict[int, int] = {}             # client -> fits so far (the state's version)
        self._disabled = False                      # set when the engine failed once
        self._said_unbatched = False                # the warning that nothing could be stacked
        self._parks = True                          # waiting results go to files (until that fails)
        self.batched_fits = 0                       # how many fits came from the engine
        self.sequential_fits = 0

    # ------------------------------------------------------------ set-up
    @classmethod
    def install(cls, course, kind: str):
        """Return the front for `kind`, or the plain trainer (with a logged reason) if it can't apply."""
        trainer = course.trainer
        if course.cfg["time.mode"] == "measured":
            log.warning("executor %s: time.mode=measured times each client's own training; "
                        "running sequentially", kind)
            return trainer
        if kind == "vectorized":
            VectorEngine = registry.engines.get("vectorized")   # noqa: N806 (a class)
            try:
                reason = VectorEngine.unsupported(trainer, course.cfg)
            except Exception as exc:  # noqa: BLE001 - a trainer without the expected attributes
                reason = f"cannot inspect trainer {type(trainer).__name__} ({exc})"
            if reason:
                log.warning("executor vectorized: %s; running sequentially", reason)
                return trainer
            engine: Engine = VectorEngine(trainer, course.cfg)
        elif kind == "ray":
            RayEngine = registry.engines.get("ray")   # noqa: N806 (a class)
            reason = RayEngine.unsupported(course)
            if reason:
                log.warning("executor ray: %s; running sequentially", reason)
                return trainer
            engine = RayEngine(course)
        else:
            ProcessEngine = registry.engines.get("processes")   # noqa: N806 (a class)
            reason = ProcessEngine.unsupported(trainer, course.cfg)
            if reason:
                log.warning("executor processes: %s; running sequentially", reason)
                return trainer
            engine = ProcessEngine(course, course.cfg["executor_workers"])
        front = cls(course, trainer, engine)
        course.comm.filters.append(front._note)    # last: sees only receivers that get the message
        return front

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        self._engine.close()

    def engine_summary(self) -> dict:
        return self._engine.summary()

    # ------------------------------------------------------------ watching sends
    def _note(self, msg: Message, receiver: int) -> bool:
        """Communicator filter: remember who will receive a broadcast model; never drops."""
        if self._disabled:
            return True
        if msg.msg_type in BATCHED_TYPES and receiver != SERVER_ID:
            key = id(msg.content)
            batch = self._batches.get(key)
            if batch is None or batch.content is not msg.content or batch.computed:
                batch = self._batches[key] = _Batch(msg.content, msg.round)
            old = self._latest.get(receiver)
            if old is not None and old != key:
                self._forget(receiver, old)
            self._latest[receiver] = key
            batch.waiting[receiver] = None
        return True

    def _forget(self, client_id: int, key: int) -> None:
        self._ready.pop((client_id, key), None)
        batch = self._batches.get(key)
        if batch is not None and client_id in batch.waiting:
            del batch.waiting[client_id]
            if not batch.waiting and not batch.computed:
                del self._batches[key]

    # ------------------------------------------------------------ fitting
    def fit(self, client_id: int, data, received: dict, round_: int) -> FitResult:
        key = id(received)
        batch = self._batches.get(key)
        if not self._disabled and batch is not None and batch.content is received \
                and batch.round == round_ and not batch.computed and client_id in batch.waiting \
                and client_id not in batch.tried and len(batch.waiting) > 1:
            self._compute(batch, key, client_id)
        ready = self._ready.pop((client_id, key), None)
        if self._latest.get(client_id) == key:
            del self._latest[client_id]
        self._release(key, client_id)
        version = self._fits.get(client_id, 0)
        self._fits[client_id] = version + 1
        if ready is not None and ready.version == version:
            self._trainer.store.save(client_id, ready.state)
            self.batched_fits += 1
            if self._engine.runs_wrappers:
                return ready.result
            return around_result(self._trainer, "fit", ready.result, client_id, data, received, round_)
        self.sequential_fits += 1
        return self._trainer.fit(client_id, data, received, round_)

    def _release(self, key: int, client_id: int) -> None:
        batch = self._batches.get(key)
        if batch is None:
            return
        batch.waiting.pop(client_id, None)
        if not batch.waiting:
            del self._batches[key]

    def _compute(self, batch: _Batch, key: int, first: int) -> None:
        """Train `first` and the next receivers not trained yet, `executor.batch_clients` at
        most (all of them by default)."""
        most = self._course.cfg["executor.batch_clients"]
        ids = list(batch.waiting)
        if most is not None:
            ids = ([first] + [c for c in ids if c != first and c not in batch.tried])[:most]
        batch.tried.update(ids)
        batch.computed = all(c in batch.tried for c in batch.waiting)
        if not self._engine.runs_wrappers and getattr(self._trainer, "spills", False):
            # its control variates stay in files only trained one client at a time (scaffold_spill)
            log.warning("executor %s: trainer %s keeps its model-sized state in files "
                        "(aggregator.spill), which a batch would stack in memory; running "
                        "sequentially", self._engine.name, type(self._trainer).__name__)
            self._disabled = True
            return
        store, clients = self._trainer.store, self._course.clients
        lazy = self._engine.loads_states
        jobs = [(cid, clients[cid].data, partial(store.load, cid) if lazy else store.load(cid)) for cid in ids]
        try:
            results = self._engine.fit_many(self._trainer, jobs, batch.content, batch.round)
        except Exception as exc:  # noqa: BLE001 - any engine failure means: run these one by one
            log.warning("executor %s: batch of %d clients failed (%s: %s); running sequentially "
                        "from now on", self._engine.name, len(ids), type(exc).__name__, exc)
            self._disabled = True
            self._engine.close()
            return
        if len(ids) > 1 and all(out is None for out in results) and not self._said_unbatched:
            self._said_unbatched = True
            log.warning("executor %s: no two of round %d's %d clients share a batch plan (the sizes "
                        "of their mini-batches step by step, and their data's shapes), so each trains "
                        "one at a time; equal training-set sizes let them train batched (the summary "
                        "counts batched_fits and sequential_fits)", self._engine.name, batch.round, len(ids))
        spill, folder = spilling(self._course)
        for cid, out in zip(ids, results):
            if out is not None:
                if spill and self._parks:   # waiting for its delivery in a file, as a spilled model does
                    self._parks = park_waiting(out[0], folder)
                self._ready[(cid, key)] = _Ready(out[0], out[1], self._fits.get(cid, 0))
