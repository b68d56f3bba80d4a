"""Local trainings on a Ray cluster (`executor: ray`).

The engine starts `executor_workers` Ray actors (by default as many as the
cluster's CPUs, or GPUs, allow at `executor.ray.num_cpus` / `num_gpus` each).
Every actor builds the course from the same config - its data, one model,
one trainer - so it holds one model for many logical clients, as the course
itself does, and no data travel: each node makes (or reads) the data itself.

Per batch, the received content is put once in Ray's object store (in frames,
framing.py, read from where the global model lies), and each
actor gets its share of (client id, client state) jobs; it runs the real
trainer's `fit` for them and yields each client's content, work, metrics
and new state as soon as that client is trained (a stream of objects, the
content in frames, as the process pool's workers send them,
framing.py); the course takes each result and decodes it
in place of what it was received into, a file where the round spills
(`aggregator.spill`), and its own state store keeps the new state. So a
client's state follows it to whichever actor trains it. Requests and replies
are `fedcore.wire.serialization` bytes (states that are not plain tensors, such as
optimizer states, as `torch.save` bytes read back with `weights_only=True`);
results are put back in the order of the jobs, so the course's numbers are
those of the sequential executor.

The process joins Ray once (`executor.ray.address`, or a local Ray started
for it) and stays in it; at the end of a run the actors wait, warm, for the
next course the process runs with the same resources.
"""
from __future__ import annotations

import io
import logging
from collections import Counter

import torch

from fedcore.kernel import registry
from fedcore.execution.batching import Engine, spilling
from fedcore.kernel.config import declare, non_negative, positive, validator
from fedcore.kernel.contract import FitResult
from fedcore.runtime.device import DeviceStateStore, to_device
from fedcore.kernel.errors import ConfigError
from fedcore.execution.framing import framed, frames_of, receive_framed, result_messages
from fedcore.execution.procpool import _decode, _encode, build_worker_course, fit_each, usable_cores, worker_values
from fedcore.wire.serialization import WireError
from fedcore.kernel.state import MemoryStateStore, plain_state

__all__ = ["RayEngine", "TrainerActor", "require_ray"]

log = logging.getLogger("fedcore.executor")

declare("executor.ray.address", str, None,
        "executor ray: the cluster to join: auto (the one this machine belongs to, started with "
        "`ray start`), HOST:PORT of its head, or ray://HOST:PORT (Ray client); null starts a "
        "local Ray for this run")
declare("executor.ray.num_cpus", float, 1.0,
        "executor ray: CPUs reserved by each actor (its torch thread count, at least 1)",
        check=positive)
declare("executor.ray.num_gpus", float, 0.0,
        "executor ray: GPUs reserved by each actor; fractions share one GPU between actors "
        "(0.25: four actors per GPU); set device too", check=non_negative)
declare("executor.ray.object_store_mb", int, None,
        "executor ray without an address: the local Ray's object store, in MB (null: Ray's "
        "default, a share of the memory)", check=positive)
declare("executor.ray.start_timeout", float, 300.0,
        "executor ray: seconds to wait for the actors to start (a cluster short of the requested "
        "resources never starts them); after it the run trains sequentially", check=positive)

_EXTRA = "executor: ray needs the optional extra 'ray' (pip install \"fedcore[ray]\")"


def require_ray():
    """The `ray` module, or ConfigError (exit 2) naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"{_EXTRA}; it is not importable here ({exc})") from None
    return ray


@validator
def _check_ray(cfg) -> None:
    if cfg["executor"] != "ray":
        return
    require_ray()
    if cfg["device"] != "cpu" and cfg["device"] != "auto" and not cfg["executor.ray.num_gpus"]:
        raise ConfigError(f"executor.ray.num_gpus: 0, but device: {cfg['device']}; Ray shows an "
                          "actor only the GPUs it reserves: give each a share (1, or 0.5 for two "
                          "per GPU)")


def _pack_state(state: dict) -> dict:
    if plain_state(state):
        return {"plain": state}
    buf = io.BytesIO()
    torch.save(state, buf)
    return {"torch": buf.getvalue()}


def _unpack_state(packed: dict) -> dict:
    if "plain" in packed:
        return packed["plain"]
    return torch.load(io.BytesIO(packed["torch"]), weights_only=True)


def _put(message: dict) -> list:
    """`message` put in Ray's object store a frame at a time (`framed`): the references."""
    import ray
    return [ray.put(bytes(part)) for part in framed(message)]


def _received(refs: list):
    """What `_put` put, read a frame at a time into one buffer, decoded in place."""
    import ray
    size, frames = _decode(ray.get(refs[0]))["size"], iter(refs[1:])
    return receive_framed(frames_of(lambda: ray.get(next(frames)), size), size, False, None)


class TrainerActor:
    """One Ray actor: the course's trainer and data, built on its node from the config."""

    def configure(self, values_yaml: str, threads: int) -> str:
        """Build this course's trainer and data here (replacing a previous course's); return
        the id of the node this actor runs on."""
        import ray
        self.trainer = self.clients = None
        course = build_worker_course(values_yaml, threads)
        self.trainer = course.trainer
        store = MemoryStateStore()    # this actor's: states go back to the course's own store
        self.trainer.store = store if course.device.type == "cpu" else DeviceStateStore(store, course.device)
        self.clients = course.clients
        self.device = course.device
        self.node = ray.get_runtime_context().get_node_id()
        return self.node

    def fit(self, head: list, jobs: list):
        """Each client's result as soon as it is trained: its messages (`result_messages`,
        the state packed), each an object of its own; an error as the last. `head` and each
        of `jobs`: the references of a `framed` message's objects, read a frame at a time."""
        try:
            req = _received(head)
            req["received"] = to_device(req["received"], self.device)
            req["jobs"] = [{"cid": j["cid"], "state": _unpack_state(j["state"])}
                           for j in map(_received, jobs)]
            for out in fit_each(self.trainer, self.trainer.store, self.clients, req):
                out["state"] = _pack_state(out["state"])
                for part in result_messages(out):
                    yield bytes(part)
        except Exception as exc:  # noqa: BLE001 - reported to the course, which falls back
            yield _encode({"error": f"{type(exc).__name__}: {exc}"})


@registry.engines.register("ray")
class RayEngine(Engine):
    name = "ray"
    runs_wrappers = True   # an actor's course installs the same behaviours' wrappers
    loads_states = True    # each job's state is loaded as it is put in the object store

    def __init__(self, course):
        self.course = course
        self.cfg = course.cfg
        self._actors: list = []
        self._nodes: list[str] = []
        self._healthy = False      # the last batch succeeded: the actors may serve another run
        self.clients_by_node: Counter = Counter()   # node id -> clients trained there

    @staticmethod
    def unsupported(course) -> str | None:
        if not getattr(course, "data_from_config", False):
            return ("the course's data were handed to it, not made from the config, so Ray's "
                    "actors cannot make them")
        return None

    def _start(self) -> None:
        ray = require_ray()
        r = self.cfg.section("executor.ray")
        if not ray.is_initialized():   # Ray then stays for this process (more runs reuse it)
            if r["address"] is None:
                store = r["object_store_mb"] * 2 ** 20 if r["object_store_mb"] else None
                ray.init(num_cpus=usable_cores(), include_dashboard=False, object_store_memory=store,
                         logging_level=logging.WARNING, log_to_driver=False)
            else:
                ray.init(address=r["address"], logging_level=logging.WARNING, log_to_driver=False)
        elif r["address"] is not None:
            log.info("executor ray: this process already runs in a Ray; executor.ray.address "
                     "is not used")
        size = self.cfg["executor_workers"] or self._fitting_actors(ray, r)
        node = ray.get_runtime_context().get_node_id()
        for stale in [k for k in _IDLE if k[0] != node]:   # actors of a Ray this process left
            del _IDLE[stale]
        self._pool_key = (node, r["num_cpus"], r["num_gpus"], size)
        self._actors = _IDLE.pop(self._pool_key, None)
        if self._actors is None:
            actor = ray.remote(TrainerActor).options(num_cpus=r["num_cpus"], num_gpus=r["num_gpus"])
            self._actors = [actor.remote() for _ in range(size)]
        text, threads = worker_values(self.cfg), max(1, int(r["num_cpus"]))
        refs = [a.configure.remote(text, threads) for a in self._actors]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=r["start_timeout"])
        if pending:
            raise TimeoutError(f"{len(pending)} of {size} Ray actors did not start in "
                               f"{r['start_timeout']:g} s (does the cluster have {r['num_cpus']:g} "
                               f"CPU(s) and {r['num_gpus']:g} GPU(s) free for each?)")
        self._nodes = ray.get(refs)
        log.info("executor ray: %d actors on %d node(s)", size, len(set(self._nodes)))

    @staticmethod
    def _fitting_actors(ray, r: dict) -> int:
        """As many actors as the cluster's CPUs (and GPUs, when actors take GPUs) hold."""
        res = ray.cluster_resources()
        n = int(res.get("CPU", 1) // r["num_cpus"])
        if r["num_gpus"]:
            n = min(n, int(res.get("GPU", 0) // r["num_gpus"]))
        return max(1, n)

    def fit_many(self, trainer, jobs, received, round_):
        import ray
        self._healthy = False
        if not self._actors:
            self._start()
        size = len(self._actors)
        # once for all actors, a frame at a time from where the global model lies
        head = _put({"received": received, "round": round_})
        calls = []
        for i, actor in enumerate(self._actors):
            share = jobs[i::size]
            if share:   # each job's state loaded as it is put
                body = [_put({"cid": cid, "state": _pack_state(load())}) for cid, _, load in share]
                # a stream of objects: each result can be taken as soon as its client is trained
                stream = actor.fit.options(num_returns="streaming").remote(head, body)
                calls.append((stream, share, self._nodes[i]))
        answers: dict[int, tuple[FitResult, dict]] = {}
        trained: dict[str, list[int]] = {}
        spill, folder = spilling(self.course)
        for stream, share, node in calls:
            for cid, _, _ in share:
                msg = _decode(ray.get(next(stream)))
                if "error" in msg:
                    raise WireError(f"a Ray actor failed: {msg['error']}")
                frames = frames_of(lambda: ray.get(next(stream)), msg["size"])
                body = receive_framed(frames, msg["size"], spill, folder)
                answers[cid] = (FitResult(body["content"], msg["work"], msg["metrics"]),
                                _unpack_state(body["state"]))
            trained.setdefault(node, []).extend(cid for cid, _, _ in share)
        for node, cids in trained.items():
            self.clients_by_node[node] += len(cids)
        log.info("executor ray: round %d: %s", round_, "; ".join(
            f"clients {sorted(c)} on node {n[:12]}" for n, c in trained.items()))
        self._healthy = True
        return [answers.get(cid) for cid, _, _ in jobs]

    def close(self) -> None:
        """Give the actors back to the idle pool, warm for the next course this process runs
        (actors whose last batch failed are killed instead). Ray itself stays until the
        process ends or calls `ray.shutdown()`."""
        if not self._actors:
            return
        if self._healthy:
            _IDLE[self._pool_key] = self._actors
        else:
            import ray
            for actor in self._actors:
                ray.kill(actor)
        self._actors = []


# (driver's node id, num_cpus, num_gpus, actors) -> idle actors of a Ray this process joined
_IDLE: dict[tuple, list] = {}
