"""A pool of worker processes for compute-heavy clients (`executor: processes`).

The workers are forked from the course's process when the first batch comes,
so each starts with the trainer, the model and every client's data already in
its memory: no data crosses a process boundary. Per batch, the parent sends
each worker the received content, the round and its share of (client id,
client state) jobs; each worker runs the real trainer's `fit` for them and
replies with each client's content, work, metrics and new state. Requests
and replies travel as `fedcore.serialization` bytes over pipes, never as
pickles. A worker trains with one torch thread, the pool has one worker per
usable core, and the parent saves the states, so results are those of the
sequential executor.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
from typing import Any

import torch

from fedcore import registry
from fedcore.contract import FitResult
from fedcore.batching import Engine
from fedcore.serialization import WireError, encode_value, from_value
from fedcore.state import MemoryStateStore
from fedcore.wire import fedcore_pb2 as pb

__all__ = ["ProcessEngine", "fit_share", "usable_cores"]

log = logging.getLogger("fedcore.executor")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _encode(obj: Any) -> bytes:
    return encode_value(obj)


def _decode(data: bytes) -> Any:
    v = pb.Value()
    v.ParseFromString(data)
    return from_value(v)


def fit_share(trainer, store, clients, req: dict) -> list[dict]:
    """What a worker does with its share of a batch: each job's client state goes into the
    worker's own store, the real trainer fits it, and the result and new state come back."""
    out = []
    for job in req["jobs"]:
        cid = job["cid"]
        store.save(cid, job["state"])
        res = trainer.fit(cid, clients[cid].data, req["received"], req["round"])
        out.append({"content": res.content, "work": float(res.work),
                    "metrics": dict(res.metrics), "state": store.load(cid)})
        store.save(cid, {})
    return out


def _serve(conn, trainer, clients) -> None:
    """A worker's loop: fit the jobs it is sent with its own copy of the trainer."""
    torch.set_num_threads(1)
    store = MemoryStateStore()
    trainer.store = store          # this process's copy only: states go back to the parent
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            req = _decode(data)
            if req.get("stop"):
                return
            req.update(_decode(conn.recv_bytes()))
            reply = _encode({"results": fit_share(trainer, store, clients, req)})
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which falls back
            reply = _encode({"error": f"{type(exc).__name__}: {exc}"})
        conn.send_bytes(reply)


@registry.engines.register("processes")
class ProcessEngine(Engine):
    name = "processes"
    runs_wrappers = True   # a worker runs the trainer's whole fit, behaviours' wrappers included

    def __init__(self, course, workers: int | None = None):
        self.course = course
        self.size = workers or usable_cores()
        self._procs: list = []
        self._conns: list = []

    @staticmethod
    def unsupported(trainer, cfg) -> str | None:
        if "fork" not in mp.get_all_start_methods():
            return "worker processes are forked and this platform cannot fork"
        if cfg["train.preserve_optimizer_state"]:
            return "train.preserve_optimizer_state: optimizer states do not serialize"
        if getattr(trainer, "device", None) is not None and trainer.device.type != "cpu":
            return f"device {trainer.device}: a forked process cannot use it (use executor ray)"
        return None

    def _start(self, trainer) -> None:
        ctx = mp.get_context("fork")   # the children inherit trainer and data: nothing is pickled
        clients = self.course.clients
        for _ in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, trainer, clients), daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        log.info("executor processes: %d worker processes", self.size)

    def fit_many(self, trainer, jobs, received, round_):
        if not self._procs:
            self._start(trainer)
        shares = [jobs[i::self.size] for i in range(self.size)]
        head = _encode({"received": received, "round": round_})   # encoded once for all workers
        busy = []
        for conn, share in zip(self._conns, shares):
            if share:
                conn.send_bytes(head)
                conn.send_bytes(_encode({"jobs": [{"cid": cid, "state": state}
                                                  for cid, _, state in share]}))
                busy.append((conn, share))
        answers: dict[int, tuple[FitResult, dict]] = {}
        errors = []
        for conn, share in busy:
            reply = _decode(conn.recv_bytes())
            if "error" in reply:
                errors.append(reply["error"])
                continue
            for (cid, _, _), r in zip(share, reply["results"]):
                answers[cid] = (FitResult(r["content"], r["work"], r["metrics"]), r["state"])
        if errors:
            raise WireError(f"a worker process failed: {errors[0]}")
        return [answers.get(cid) for cid, _, _ in jobs]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(_encode({"stop": True}))
                conn.close()
            except OSError:
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
        self._procs, self._conns = [], []
