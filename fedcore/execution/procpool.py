"""A pool of worker processes for compute-heavy clients (`executor: processes`).

The workers start when the first batch comes, from a fresh interpreter
(`forkserver`, or `spawn` where there is none), never forked from the course's
process: they inherit no autograd or CUDA threads and the pool works on every
platform. Each receives what it needs explicitly - the course's config, as
Ray's actors do - and builds the same trainer and clients' data from it (data
handed to the course, not made from its config, are sent once as tensors; a client's
data that a mapping makes on access go with each of its jobs). Per batch, the parent sends each worker the
received content, the round and its share of (client id, client state) jobs, each
state loaded from the course's store as its job is sent; each worker runs the real
trainer's `fit` for them and sends each client's content, work, metrics and new state as
soon as that client is trained (framing.py: the received content and the jobs go to the
workers, and each result comes back, in frames). The parent takes
results from whichever worker has one and decodes each in place of what it was received
into (a buffer of its size, or, where the round spills its large models, `aggregator.spill`,
an unlinked file it maps): a result waiting for its client's delivery is one copy of its
model, in the page cache where the round spills. Config, requests and replies
travel as bytes over pipes (YAML, `fedcore.wire.serialization`), never as pickles.
A worker trains with one torch thread, ignores Ctrl-C (the course handles it
and closes the pool), the pool has one worker per usable core, and the parent
saves the states, so results are those of the sequential executor.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from multiprocessing.connection import wait
from typing import Any

import torch
import yaml

from fedcore.kernel import registry
from fedcore.kernel.contract import FitResult
from fedcore.execution.batching import Engine, spilling
from fedcore.execution.executor import usable_cores
from fedcore.runtime.device import made_on_access
from fedcore.execution.framing import framed, frames_of, receive_framed, result_messages
from fedcore.wire.serialization import WireError, encode_value, from_value
from fedcore.kernel.state import MemoryStateStore
from fedcore.wire import fedcore_pb2 as pb

try:
    import resource
except ImportError:   # not on Windows: the workers' memory goes unreported
    resource = None

__all__ = ["ProcessEngine", "build_worker_course", "fit_each", "usable_cores", "worker_values"]

log = logging.getLogger("fedcore.executor")


# a fresh interpreter for every worker: fork would copy the course's autograd/CUDA threads' state
_START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"

# what the fork server imports once for all the workers it forks (a course's plug-ins, and
# torch._dynamo, which torch.optim imports at its first optimizer): each worker starts warm
_PRELOAD = ["fedcore.execution.procpool", "fedcore.runtime.course", "fedcore.algorithms", "fedcore.handlers",
            "fedcore.scenarios", "fedcore.deployment.distributed", "torch._dynamo"]


def _encode(obj: Any) -> bytes:
    return encode_value(obj)


def _decode(data: bytes) -> Any:
    v = pb.Value()
    v.ParseFromString(data)
    return from_value(v)


def fit_each(trainer, store, clients, req: dict, data=None):
    """What a worker does with its share of a batch, one client at a time: each job's client
    state goes into the worker's own store, the real trainer fits it, and its result and new
    state are yielded as soon as it is trained. A job that carries its client's data
    (`_data_of`) is trained on them; `data` is the worker's course's FederatedData, whose
    shape they take."""
    for job in req["jobs"]:
        cid = job["cid"]
        store.save(cid, job["state"])
        own = clients[cid].data if "data" not in job else _client_of(cid, job["data"], data)
        res = trainer.fit(cid, own, req["received"], req["round"])
        out = {"content": res.content, "work": float(res.work),
               "metrics": dict(res.metrics), "state": store.load(cid)}
        store.save(cid, {})
        yield out


def worker_values(cfg) -> str:
    """The config as a worker builds its course from it: trained one client at a time, no
    outputs, no resuming. Keys left at their default are not sent: a worker knows the
    defaults, and need not know keys that plug-ins imported here declared and this course
    does not use."""
    from fedcore.kernel.config import SCHEMA, safe_dump
    values = {k: cfg[k] for k in SCHEMA if k in cfg and cfg[k] != SCHEMA[k].default}
    # the worker's threads are set where it builds the course (build_worker_course)
    values.update({"executor": "sequential", "outdir": None, "resume_from": None, "torch_threads": None})
    return safe_dump(values)


def build_worker_course(values_yaml: str, threads: int, data=None):
    """The course a worker (a process of the pool, or a Ray actor) builds from `worker_values`:
    its trainer and clients' data are the course's own, made here (or `data`, as handed to
    the course)."""
    from fedcore.kernel.config import load_config
    from fedcore.runtime.course import Course
    torch.set_num_threads(threads)
    return Course(load_config(None, extra=yaml.safe_load(values_yaml))).build(data)


def _data_of(client) -> list:
    """A client's splits as tensors: [[x, y] of train, of val, of test]."""
    return [[s.x, s.y] for s in (client.train, client.val, client.test)]


def _encode_data(data) -> bytes:
    """A course's FederatedData as `fedcore.wire.serialization` bytes (its splits are tensors); with
    clients made on access, none (their data go with each job)."""
    on_access = made_on_access(data.clients)
    clients = [] if on_access else [[cid, *_data_of(c)] for cid, c in data.clients.items()]
    return _encode({"clients": clients, "on_access": on_access,
                    "test": [data.server_test.x, data.server_test.y],
                    "shape": list(data.input_shape), "num_classes": int(data.num_classes)})


class _SentWithJobs(dict):
    """A worker's clients whose data come with each job: empty until then."""

    def __init__(self, empty):
        super().__init__()
        self.empty = empty

    def __missing__(self, cid: int):
        return self.empty


def _decode_data(raw: bytes):
    d = _decode(raw)
    build = registry.components.get("federated_data_from_splits")
    data = build({cid: (tr, va, te) for cid, tr, va, te in d["clients"]}, d["test"], d["shape"],
                 d["num_classes"])
    if d["on_access"]:
        x, y = d["test"]
        empty = (x[:0], y[:0])
        data.clients = _SentWithJobs(build({0: (empty, empty, empty)}, empty, d["shape"],
                                           d["num_classes"]).clients[0])
    return data


def _client_of(cid: int, splits: list, data):
    """Client `cid`'s data as a job carried them."""
    return registry.components.get("federated_data_from_splits")(
        {cid: splits}, splits[2], data.input_shape, data.num_classes).clients[cid]


def _received(conn) -> Any:
    """The next `framed` message on `conn`, decoded in place of the buffer it is received into."""
    size = _decode(conn.recv_bytes())["size"]
    return receive_framed(frames_of(conn.recv_bytes, size), size, False, None)


def _serve(conn) -> None:
    """A worker's loop: build the course from the config it is sent, then fit the jobs it is
    sent with its own trainer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the course's to handle
    try:
        values = conn.recv_bytes().decode()
        raw = conn.recv_bytes()
        course = build_worker_course(values, 1, _decode_data(raw) if raw else None)
        torch.set_num_threads(1)
        trainer, clients = course.trainer, course.clients
        store = MemoryStateStore()
        trainer.store = store          # this process's only: states go back to the parent
        conn.send_bytes(_encode({"ready": True}))
    except (EOFError, OSError):
        return
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which falls back
        conn.send_bytes(_encode({"error": f"building the course: {type(exc).__name__}: {exc}"}))
        return
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            head = _decode(data)
            if head.get("stop"):
                return
            req = receive_framed(frames_of(conn.recv_bytes, head["size"]), head["size"], False, None)
            req["jobs"] = [_received(conn) for _ in range(req["jobs"])]
            for out in fit_each(trainer, store, clients, req, course.data):
                for part in result_messages(out):   # as soon as it is trained, not with the share
                    conn.send_bytes(part)
            reply = _encode({"done": True, "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                             if resource is not None else 0})
        except (BrokenPipeError, ConnectionResetError):
            return
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which falls back
            reply = _encode({"error": f"{type(exc).__name__}: {exc}"})
        conn.send_bytes(reply)


@registry.engines.register("processes")
class ProcessEngine(Engine):
    name = "processes"
    runs_wrappers = True   # a worker runs the trainer's whole fit, behaviours' wrappers included
    loads_states = True    # each job's state is loaded as it is sent

    def __init__(self, course, workers: int | None = None):
        self.course = course
        self.size = workers or usable_cores()
        self._procs: list = []
        self._conns: list = []
        self._with_jobs = False   # clients' data go with each job (made on access)
        self._peak_kb = 0         # the largest peak resident memory a worker reported

    @staticmethod
    def unsupported(trainer, cfg) -> str | None:
        if cfg["train.preserve_optimizer_state"]:
            return "train.preserve_optimizer_state: optimizer states do not serialize"
        if getattr(trainer, "device", None) is not None and trainer.device.type != "cpu":
            return f"device {trainer.device}: the pool's workers train on the CPU (use executor ray)"
        return None

    def _start(self, trainer) -> None:
        ctx = mp.get_context(_START_METHOD)
        if _START_METHOD == "forkserver":
            ctx.set_forkserver_preload(_PRELOAD)
        config = worker_values(self.course.cfg).encode()
        # data handed to the course (not made from its config) go to the workers as tensors
        handed = not getattr(self.course, "data_from_config", True)
        data = _encode_data(self.course.data) if handed else b""
        self._with_jobs = handed and made_on_access(self.course.data.clients)
        for _ in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child,), daemon=True)
            p.start()
            child.close()
            parent.send_bytes(config)
            parent.send_bytes(data)
            self._procs.append(p)
            self._conns.append(parent)
        for conn in self._conns:     # every worker has built its course, or says why not
            reply = _decode(conn.recv_bytes())
            if "error" in reply:
                raise WireError(f"a worker process failed: {reply['error']}")
        log.info("executor processes: %d worker processes", self.size)

    def fit_many(self, trainer, jobs, received, round_):
        if not self._procs:
            self._start(trainer)
        shares = [jobs[i::self.size] for i in range(self.size)]
        busy = []
        for conn, share in zip(self._conns, shares):
            if share:
                # in frames, from where the global model lies (a parked one's pages go back), then
                # each job, its state loaded as it is sent
                for part in framed({"received": received, "round": round_, "jobs": len(share)}):
                    conn.send_bytes(part)
                for cid, data, load in share:
                    job = {"cid": cid, "state": load(), **({"data": _data_of(data)} if self._with_jobs else {})}
                    for part in framed(job):
                        conn.send_bytes(part)
                    del job
                busy.append((conn, share))
        answers: dict[int, tuple[FitResult, dict]] = {}
        errors = []
        spill, folder = spilling(self.course)
        left = {conn: list(share) for conn, share in busy}   # each worker's jobs not answered yet
        while left:
            for conn in wait(list(left)):   # whichever worker has a result: as each is trained
                msg = _decode(conn.recv_bytes())
                if "size" in msg:
                    cid = left[conn].pop(0)[0]
                    frames = frames_of(conn.recv_bytes, msg["size"])
                    body = receive_framed(frames, msg["size"], spill, folder)
                    answers[cid] = (FitResult(body["content"], msg["work"], msg["metrics"]), body["state"])
                    continue
                if "error" in msg:
                    errors.append(msg["error"])
                self._peak_kb = max(self._peak_kb, msg.get("peak_kb", 0))
                del left[conn]
        if errors:
            raise WireError(f"a worker process failed: {errors[0]}")
        return [answers.get(cid) for cid, _, _ in jobs]

    def summary(self) -> dict:
        """The workers' largest peak resident memory (a fork server's workers are not this
        process's children, so its own accounting of children does not see them)."""
        return {"worker_peak_rss_mb": round(self._peak_kb / 1024, 1)} if self._peak_kb else {}

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
