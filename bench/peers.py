"""The peers' own benchmarks, shaped as they publish them, against a plain PyTorch loop.

    python -m bench.peers --workload p1|p2 [--device cpu|cuda] [--rounds R] [--users U]

P1 (pfl-research's CIFAR10 benchmark): U=1000 users x 50 images 3x32x32, 50 users per round,
5 local steps at batch 10, a small CNN with dropout (convnet2 without normalisation: two 5x5
conv layers of 32 and 64 channels, dropout 0.25, a dense layer of 128, dropout 0.25, the
classifier), SGD lr 0.1, FedAvg; 3 rounds by default.
P2 (FLUTE's LR_MNIST benchmark): U=1000 clients x 60 images 1x28x28, 10 per round, 6 local
steps at batch 10, logistic regression 784->10, SGD lr 0.03, FedAvg; 100 rounds by default.

Data are synthetic, made on access from (seed, client): class patterns under noise. Each
system runs in a process of its own (forked from this one), so its peak resident memory is
its own: the plain loop (one torch thread unless --plain-threads), fedcore sequential (the default config),
sequential with all cores, vectorized and processes (on the CPU) or vectorized without CUDA
graphs (on a GPU). Equal work is checked first, in `--check-dtype` (float64 by default: P1's
course at lr 0.1 turns float32 rounding into differences of 1e-5 on the CPU and 3e-4 on a GPU,
where grouped and single convolutions round differently, which would hide whether two systems
did the same work; in float64 that rounding stays far below the tolerance). With dropout 0
each of fedcore's executors must end on the model of a plain loop replaying its client choice
and batch order; with dropout on, each executor on the sequential one's model (the same
masks, drawn from each client's own stream). Both to `TOLERANCE[dtype]`; on a GPU cuDNN's
TF32 convolutions are off for the check. A system that fails a check is named on stderr and
the exit status is 1, after the figures. The timed runs have dropout on, float32 and torch's
default precision; their vectorized model is compared with the sequential one. One table,
then one `key=value` line. Time per round is the median wall time of the rounds after the
first; whole run is build to final model.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from typing import Callable

import torch
import torch._dynamo  # noqa: F401 - imported by every first optimizer (~1.2 s): once here, not in each child

from bench.common import _LazyClients, bench_cfg, max_abs_diff, run_fedcore, run_plain
from fedcore.runtime.device import place_data
from fedcore.execution.procpool import _decode, _encode, usable_cores
from fedcore.scenarios.data import ClientData, FederatedData, Split

__all__ = ["WORKLOADS", "workload_data", "workload_cfg", "main"]

WORKLOADS = {
    "p1": dict(shape=(3, 32, 32), samples=50, per_round=50, steps=5, lr=0.1, rounds=3,
               model={"model.type": "convnet2", "model.norm": "none", "model.convnet2_hidden": 128,
                      "model.dropout": 0.25}),
    "p2": dict(shape=(1, 28, 28), samples=60, per_round=10, steps=6, lr=0.03, rounds=100,
               model={"model.type": "logreg"}),
}
CLASSES = 10
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}   # largest |difference| of a parameter
SYSTEMS = ("sequential", "sequential-all-cores", "vectorized", "vectorized-eager", "processes")


def _templates(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """One smooth pattern per class (a coarse random grid, bilinearly enlarged)."""
    g = torch.Generator().manual_seed(seed * 7919 + 2)
    coarse = torch.randn((CLASSES, shape[0], 8, 8), generator=g)
    return torch.nn.functional.interpolate(coarse, size=shape[1:], mode="bilinear", align_corners=False)


def _shard(seed: int, client_id: int, n: int, templates: torch.Tensor) -> Split:
    """Client `client_id`'s n images: its labels' patterns under Gaussian noise, in the
    templates' dtype."""
    g = torch.Generator().manual_seed(seed + client_id)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    noise = torch.randn((n,) + tuple(templates.shape[1:]), generator=g).to(templates.dtype)
    return Split(templates[y] + 2.0 * noise, y)


def workload_data(name: str, users: int, seed: int = 0, resident: bool = False,
                  dtype: str = "float32") -> FederatedData:
    """The workload's data in `dtype`, each client's made on access; with `resident` all made
    at once (what a GPU course needs to keep them on the device)."""
    w = WORKLOADS[name]
    templates = _templates(seed, w["shape"]).to(getattr(torch, dtype))
    clients = _LazyClients(seed, users, w["samples"], templates, _shard)
    if resident:
        clients = {cid: ClientData(c.train, c.val, c.test)
                   for cid, c in ((cid, clients[cid]) for cid in range(1, users + 1))}
    return FederatedData(clients, _shard(seed, 10_000_000, 200, templates), w["shape"], CLASSES)


def workload_cfg(name: str, users: int, rounds: int, device: str, executor: str = "sequential",
                 dropout: bool = True, dtype: str = "float32", **extra):
    w = WORKLOADS[name]
    model = dict(w["model"])
    if not dropout and "model.dropout" in model:
        model["model.dropout"] = 0.0
    return bench_cfg(**{
        "federate.client_num": users, "federate.sample_client_num": min(w["per_round"], users),
        "federate.total_round_num": rounds, "train.local_steps": w["steps"],
        "train.batch_size": 10, "train.optimizer.lr": w["lr"], "device": device,
        "executor": executor, "torch_threads": "auto", "model.dtype": dtype,   # fedcore's default
        **model, **extra})


# ---------------------------------------------------------------- one system, one process
def _measure(fn: Callable[[], tuple], conn, exact: bool) -> None:
    """In the forked child: run, then send back (as fedcore serialization, never a pickle) the
    round times, the whole run's time, peak memory and the final model. `exact` turns off
    cuDNN's TF32 convolutions (on by torch's default on a GPU), whose 10-bit rounding differs
    between algorithms and would hide whether two systems did the same work."""
    if exact:
        torch.backends.cudnn.allow_tf32 = False
    try:
        start = time.perf_counter()
        times, fits, workers_kb = fn()
        whole = time.perf_counter() - start
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        state = {k: v.cpu() for k, v in times.final_state.items()}
        kids = max(kids, workers_kb)   # a pool's workers, children of its fork server
        conn.send_bytes(_encode({"rounds": times.wall_rounds, "whole": whole, "rss_kb": own,
                                 "children_rss_kb": kids, "state": state, "fits": fits}))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        conn.send_bytes(_encode({"error": f"{type(exc).__name__}: {exc}"}))
    finally:
        conn.close()


def in_child(fn: Callable[[], tuple], exact: bool = False) -> dict:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_measure, args=(fn, child, exact))
    p.start()
    child.close()
    try:
        out = _decode(parent.recv_bytes())
    finally:
        p.join()
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


def _data(name: str, users: int, cfg) -> FederatedData:
    return workload_data(name, users, resident=cfg["device"] != "cpu", dtype=cfg["model.dtype"])


def _fedcore(name: str, users: int, cfg) -> Callable[[], tuple]:
    def run():
        seen = {}
        times = run_fedcore(cfg, _data(name, users, cfg),
                            before_run=lambda course: seen.setdefault("course", course))
        summary = seen["course"].monitor.extra_summary
        return (times, [summary.get("batched_fits", 0), summary.get("sequential_fits", 0)],
                int(summary.get("worker_peak_rss_mb", 0.0) * 1024))
    return run


def _plain(name: str, users: int, cfg, device: str, threads: int | None) -> Callable[[], tuple]:
    def run():
        if threads is not None:
            torch.set_num_threads(threads)
        # on a GPU the plain loop's data are there before it starts, as fedcore keeps them
        data = place_data(_data(name, users, cfg), torch.device(device), None)
        return run_plain(cfg, data, device), [0, 0], 0
    return run


# ---------------------------------------------------------------- the run
def systems(name: str, users: int, rounds: int, device: str, dropout: bool, workers: int,
            plain_threads: int | None = 1, chosen: tuple[str, ...] = SYSTEMS,
            dtype: str = "float32"):
    """(label, thunk) per system, the plain loop first. Each thunk makes its data itself: this
    process computes nothing with torch, so its forked children start with no thread pool."""
    cfg = lambda executor, **extra: workload_cfg(name, users, rounds, device, executor, dropout,  # noqa: E731
                                                 dtype, **extra)
    out = [("plain", _plain(name, users, cfg("sequential"), device, plain_threads)),
           ("sequential", _fedcore(name, users, cfg("sequential"))),
           ("sequential-all-cores", _fedcore(name, users, cfg("sequential", torch_threads=None))),
           ("vectorized", _fedcore(name, users, cfg("vectorized")))]
    if device == "cpu":
        out.append(("processes", _fedcore(name, users, cfg("processes", executor_workers=workers))))
    else:   # the GPU step launched kernel by kernel (no CUDA graphs)
        out.append(("vectorized-eager", _fedcore(name, users, cfg(
            "vectorized", **{"executor.vectorized.cuda_graphs": False}))))
    return [(label, fn) for label, fn in out if label in ("plain", "sequential") + tuple(chosen)]


def check(name: str, runs: dict[str, dict], reference: str, what: str, tolerance: float) -> list[str]:
    """The systems in `runs` whose final model is not `reference`'s to `tolerance` (or that
    failed), each difference printed. Called once every process has run: a tensor operation
    here would start torch's thread pool in this process, and a child forked after that can
    hang in its first parallel one."""
    if "error" in runs[reference]:
        print(f"equal work ({name}, {what}): {reference} failed: {runs[reference]['error']}")
        return [f"{reference} ({what}: failed)"]
    ref = runs[reference]["state"]
    unequal = []
    for label, r in runs.items():
        if label == reference:
            continue
        if "error" in r:
            print(f"equal work ({name}, {what}): {label} failed: {r['error']}")
            unequal.append(f"{label} ({what}: failed)")
            continue
        d = max_abs_diff(r["state"], ref)
        print(f"equal work ({name}, {what}): {label} vs {reference} max |diff| {d:.2e}")
        if d > tolerance:
            unequal.append(f"{label} ({what}: {d:.2e})")
    return unequal


def _checked(fn: Callable[[], tuple]) -> dict:
    """`in_child` for a check: a system that fails is reported with the others, after them."""
    try:
        return in_child(fn, exact=True)
    except RuntimeError as exc:
        return {"error": str(exc)}


def _mb(r: dict, label: str, workers: int) -> float:
    kb = r["rss_kb"] + (r["children_rss_kb"] * workers if label == "processes" else 0)
    return kb / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=None, help="default: the workload's (p1 3, p2 100)")
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--workers", type=int, default=usable_cores(), help="processes executor")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="fedcore's systems to run beside the plain loop (sequential is always run)")
    p.add_argument("--check-dtype", choices=sorted(TOLERANCE), default="float64",
                   help="dtype of the equal-work checks (the timed runs are float32)")
    p.add_argument("--plain-threads", type=int, default=1,
                   help="torch threads of the plain loop (0: torch's default, all cores)")
    a = p.parse_args(argv)
    # asked through NVML, which leaves CUDA uninitialised here: the systems run in forked
    # children, and a child of a process that initialised CUDA cannot use it
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench.peers: --device cuda needs a CUDA GPU and torch sees none", file=sys.stderr)
        return 2
    rounds = a.rounds or WORKLOADS[a.workload]["rounds"]
    if rounds < 2:
        p.error("--rounds must be at least 2 (time per round is measured after the first)")
    name = a.workload
    print(f"{name} on {a.device}: {a.users} users, {rounds} rounds, {os.cpu_count()} CPUs "
          f"({usable_cores()} usable), torch {torch.__version__}; plain loop on "
          f"{a.plain_threads or 'all'} thread(s)")
    threads = a.plain_threads or None
    chosen = tuple(a.systems.split(","))
    unknown = set(chosen) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SYSTEMS)})")
    check_rounds, dtype = min(rounds, 2), a.check_dtype
    replays = {label: _checked(fn) for label, fn in systems(
        name, a.users, check_rounds, a.device, False, a.workers, threads, chosen, dtype)}
    has_dropout = "model.dropout" in WORKLOADS[name]["model"]
    masks = {label: _checked(fn) for label, fn in systems(
        name, a.users, check_rounds, a.device, True, a.workers, threads, chosen, dtype)
        if label != "plain"} if has_dropout else {}
    results = {label: in_child(fn) for label, fn in
               systems(name, a.users, rounds, a.device, True, a.workers, threads, chosen)}
    unequal = check(name, replays, "plain", f"{dtype}, dropout 0", TOLERANCE[dtype])
    if masks:
        unequal += check(name, masks, "sequential", f"{dtype}, dropout on", TOLERANCE[dtype])
    per_round = {k: statistics.median(r["rounds"][1:]) for k, r in results.items()}
    plain = results["plain"]
    print(f"\n{'system':<22}{'s/round':>10}{'x plain':>9}{'whole run s':>13}{'peak MB':>10}"
          f"{'batched/sequential fits':>25}")
    for label, r in results.items():
        print(f"{label:<22}{per_round[label]:>10.4f}{per_round[label] / per_round['plain']:>9.3f}"
              f"{r['whole']:>13.2f}{_mb(r, label, a.workers):>10.0f}"
              f"{'{}/{}'.format(*r['fits']) if label != 'plain' else '':>25}")
    vec = results.get("vectorized")
    vec_diff = max_abs_diff(vec["state"], results["sequential"]["state"]) if vec else float("nan")
    if "processes" in results:
        print(f"(processes: peak MB counts the parent and {a.workers} workers, each at the largest "
              f"worker's peak; shared pages are counted in each)")
    fedcore = [k for k in results if k != "plain"]
    best = min(fedcore, key=per_round.get)
    ratio = lambda k: per_round[k] / per_round["plain"]  # noqa: E731
    batched, sequential = vec["fits"] if vec else results["sequential"]["fits"]
    vec_ratio = ratio("vectorized") if vec else float("nan")
    print(f"vectorized_over_plain={vec_ratio:.3f} sequential_over_plain={ratio('sequential'):.3f} "
          f"best_over_plain={ratio(best):.3f} best={best} "
          f"peak_rss_over_plain={_mb(results['sequential'], 'sequential', 1) / _mb(plain, 'plain', 1):.3f} "
          f"batched_fits={batched} sequential_fits={sequential} vectorized_vs_sequential_diff={vec_diff:.2e}")
    if unequal:   # the figures above are printed all the same, for the record
        print(f"bench.peers: not the same work to {TOLERANCE[dtype]:g}: {', '.join(unequal)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
