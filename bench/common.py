"""Shared pieces of the benchmarks: the synthetic workload data, LeNet-5, a fedcore
run that reports per-round wall seconds, and the plain-PyTorch reference loop.

The reference loop does the identical work a fedcore FedAvg course does (same
data tensors, same sampled clients, same mini-batch indices, one reused model,
the same sample-weighted average in the same order), so its final model must
equal fedcore's; each benchmark checks that before it prints a ratio.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from fedcore.kernel import registry
from fedcore.kernel.contract import BatchStream, evaluate_model, weighted_mean
from fedcore.kernel.config import load_config
from fedcore.scenarios.data import ClientData, FederatedData, Split
from bench.images import INPUT_SHAPE, NUM_CLASSES, LeNet5, class_templates, image_samples

__all__ = ["INPUT_SHAPE", "NUM_CLASSES", "client_shard", "image_shard", "bench_data", "LazyClientData",
           "bench_cfg", "run_fedcore", "run_plain", "RoundTimes", "report", "lenet5",
           "compare_with_plain"]


# ---------------------------------------------------------------- data
def _teacher(seed: int) -> torch.Tensor:
    """A fixed linear labeller, so the synthetic task is learnable (accuracy means something)."""
    g = torch.Generator().manual_seed(seed * 7919 + 1)
    return torch.randn(math.prod(INPUT_SHAPE), NUM_CLASSES, generator=g)


def client_shard(seed: int, client_id: int, n: int, teacher: torch.Tensor) -> Split:
    """Client `client_id`'s n samples, generated from `seed + client_id` alone."""
    g = torch.Generator().manual_seed(seed + client_id)
    x = torch.randn((n,) + INPUT_SHAPE, generator=g)
    y = (x.reshape(n, -1) @ teacher).argmax(1)
    return Split(x, y)


def _empty() -> Split:
    return Split(torch.empty((0,) + INPUT_SHAPE), torch.empty(0, dtype=torch.long))


def image_shard(seed: int, client_id: int, n: int, templates: torch.Tensor) -> Split:
    """Client `client_id`'s n images (`bench.images.image_samples`): class patterns under noise."""
    return Split(*image_samples(seed, client_id, n, templates))


class LazyClientData:
    """A client's data made on access from its seed: 10^5 clients need no resident shards."""

    __slots__ = ("seed", "cid", "n", "teacher", "shard")

    def __init__(self, seed: int, cid: int, n: int, teacher: torch.Tensor, shard=None):
        self.seed, self.cid, self.n, self.teacher = seed, cid, n, teacher
        self.shard = shard or client_shard

    @property
    def train(self) -> Split:
        return self.shard(self.seed, self.cid, self.n, self.teacher)

    @property
    def val(self) -> Split:
        return _empty()

    test = val


class _LazyClients(dict):
    def __init__(self, seed: int, n_clients: int, n: int, teacher: torch.Tensor, shard=None):
        super().__init__()
        self.args = (seed, n, teacher, shard)
        self.n_clients = n_clients

    def __missing__(self, cid: int) -> LazyClientData:
        seed, n, teacher, shard = self.args
        return LazyClientData(seed, cid, n, teacher, shard)

    def __len__(self) -> int:
        return self.n_clients


def bench_data(n_clients: int, n_samples: int, seed: int, test_n: int = 500,
               lazy: bool = False, images: bool = False) -> FederatedData:
    """All of a client's samples are training data; the server tests on a separate shard.
    Inputs are noise labelled by a linear teacher, or with `images` class patterns under noise."""
    teacher, shard = (class_templates(seed), image_shard) if images else (_teacher(seed), client_shard)
    if lazy:
        clients = _LazyClients(seed, n_clients, n_samples, teacher, shard)
    else:
        clients = {cid: ClientData(shard(seed, cid, n_samples, teacher), _empty(), _empty())
                   for cid in range(1, n_clients + 1)}
    server_test = shard(seed, 10_000_000, test_n, teacher)
    return FederatedData(clients, server_test, INPUT_SHAPE, NUM_CLASSES)


# ---------------------------------------------------------------- model
def lenet5(cfg, input_shape, num_classes: int) -> nn.Module:
    return LeNet5(num_classes)


if "lenet5" not in registry.models:  # the scenarios may provide their own
    registry.models.register("lenet5", lenet5)


# ---------------------------------------------------------------- config
def bench_cfg(**dotted) -> object:
    """A config for a benchmark: no output files, no client evaluation, eval at the end only,
    and torch's threads left as the benchmark set them (its --threads, for fedcore and the
    plain loop alike)."""
    base = {"seed": 0, "verbose": False, "data.splits": [1.0, 0.0, 0.0],
            "eval.clients": False, "eval.freq": 10_000, "torch_threads": None}
    base.update(dotted)
    return load_config(None, extra=base)


# ---------------------------------------------------------------- timing
CLOCK = "cpu"   # "cpu": process CPU seconds (robust on a shared machine); "wall": elapsed seconds


class _Clock:
    """Both clocks at once; per-round differences of either are kept."""

    def __init__(self) -> None:
        self.wall: list[float] = [time.perf_counter()]
        self.cpu: list[float] = [time.process_time()]

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def rounds(self) -> tuple[list[float], list[float]]:
        d = lambda v: [b - a for a, b in zip(v, v[1:])]  # noqa: E731
        return d(self.wall), d(self.cpu)


@dataclass
class RoundTimes:
    """Seconds of each round, wall and CPU (round 1 includes the course's start-up)."""

    wall_rounds: list[float]
    cpu_rounds: list[float]
    final_state: dict[str, torch.Tensor]
    label: str = ""
    accuracy: list[float] = field(default_factory=list)   # test accuracy of each evaluated round

    @property
    def rounds(self) -> list[float]:
        return self.cpu_rounds if CLOCK == "cpu" else self.wall_rounds

    @property
    def first(self) -> float:
        return self.rounds[0]

    @property
    def steady(self) -> float:
        rest = self.rounds[1:] or self.rounds
        return statistics.median(rest)

    @property
    def steady_wall(self) -> float:
        rest = self.wall_rounds[1:] or self.wall_rounds
        return statistics.median(rest)


def run_fedcore(cfg, data: FederatedData, before_run: Callable | None = None,
                until_acc: float | None = None) -> RoundTimes:
    """Build and run a fedcore course; round times come from its own per-round records.
    With `until_acc` the run stops after the first round whose test accuracy reaches it."""
    from fedcore.runtime.course import Course, CourseStalled
    clock = _Clock()   # the build counts in round 1, like the reference's set-up
    course = Course(cfg, outdir=None).build(data)
    if before_run is not None:
        before_run(course)
    record_round = course.monitor.record_round
    accuracy: list[float] = []

    def timed_record(round_, virtual_time, fields, *args, **kwargs):   # a round ends here
        clock.tick()
        if "test_acc" in fields:
            accuracy.append(fields["test_acc"])
            if until_acc is not None and fields["test_acc"] >= until_acc:
                course.scheduler.stop()    # after this event: the rest of the course is dropped
        return record_round(round_, virtual_time, fields, *args, **kwargs)
    course.monitor.record_round = timed_record
    try:
        course.run()
    except CourseStalled:   # stopped at the target, before the course's last round
        if until_acc is None or not accuracy or accuracy[-1] < until_acc:
            raise
    state = {k: v.detach().clone() for k, v in course.server.aggregator.global_state.items()}
    return RoundTimes(*clock.rounds(), state, "fedcore", accuracy)


def run_plain(cfg, data: FederatedData, device: str = "cpu", until_acc: float | None = None) -> RoundTimes:
    """The plain-PyTorch loop doing exactly what the fedcore course does (FedAvg, or SCAFFOLD
    when `algorithm.name` is scaffold: each client's control variate c_i kept in a dict), with
    its model on `device` (the data on whatever device the caller put them). With `until_acc`
    it stops after the first round whose test accuracy reaches it."""
    from fedcore.scenarios.models import build_model
    clock = _Clock()
    seed = cfg["seed"]
    n_clients = cfg["federate.client_num"]
    k = cfg["federate.sample_client_num"] or n_clients
    rounds_n = cfg["federate.total_round_num"]
    bs, lr = cfg["train.batch_size"], cfg["train.optimizer.lr"]
    scaffold = cfg["algorithm.name"] == "scaffold"
    if cfg["algorithm.name"] not in ("fedavg", "scaffold"):
        raise ValueError(f"the plain reference has no {cfg['algorithm.name']}")
    if scaffold and (cfg["algorithm.scaffold.weighting"] != "uniform"
                     or cfg["algorithm.scaffold.global_lr"] != 1.0):
        raise ValueError("the plain SCAFFOLD reference is the paper's: uniform mean, global_lr 1")
    model = build_model(cfg, data.input_shape, data.num_classes).to(device)
    global_state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    params = dict(model.state_dict(keep_vars=True))
    trainable = {n: p for n, p in model.named_parameters()}
    control = {n: torch.zeros_like(p) for n, p in trainable.items()}     # SCAFFOLD's c
    c_clients: dict[int, dict[str, torch.Tensor]] = {}                  # SCAFFOLD's c_i
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed + 3)        # the uniform sampler's stream
    positions: dict[int, tuple[int, int]] = {}
    ids = list(range(1, n_clients + 1))
    accuracy: list[float] = []
    for r in range(1, rounds_n + 1):
        picked = sorted(ids[i] for i in rng.choice(n_clients, size=k, replace=False))
        updates, weights, d_controls = [], [], []
        for cid in picked:
            train = data.clients[cid].train
            with torch.no_grad():
                for name, t in global_state.items():
                    params[name].copy_(t)
            epoch, offset = positions.get(cid, (0, 0))
            stream = BatchStream(len(train), bs, seed, cid, epoch, offset)
            steps = cfg["train.local_steps"] or cfg["train.local_epochs"] * math.ceil(len(train) / bs)
            if scaffold:
                c_i = c_clients.get(cid)
                corr = {n: control[n].clone() if c_i is None else control[n] - c_i[n] for n in trainable}
            model.train()
            for _ in range(steps):
                idx = stream.next()
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(train.x[idx]), train.y[idx])
                loss.backward()
                if scaffold:
                    with torch.no_grad():
                        for n, p in trainable.items():
                            p.grad.add_(corr[n])
                opt.step()
                loss.item()
            positions[cid] = (stream.epoch, stream.offset)
            y = {n: t.detach().clone() for n, t in params.items()}
            if scaffold:
                with torch.no_grad():
                    x = global_state
                    c_i = c_i or {n: torch.zeros_like(control[n]) for n in trainable}
                    new = {n: c_i[n] - control[n] + (x[n] - y[n]) / (steps * lr) for n in trainable}
                    d_controls.append({n: new[n] - c_i[n] for n in trainable})
                    c_clients[cid] = new
                    updates.append({n: y[n] - x[n] for n in y})
                weights.append(1.0)
            else:
                updates.append(y)
                weights.append(float(len(train)))
        if scaffold:
            global_state = {n: global_state[n] + weighted_mean([u[n] for u in updates], weights)
                            for n in global_state}
            control = {n: c + torch.stack([d[n] for d in d_controls]).sum(0) / n_clients
                       for n, c in control.items()}
        else:
            global_state = {n: weighted_mean([u[n] for u in updates], weights) for n in global_state}
        if r % cfg["eval.freq"] == 0 or r == rounds_n:
            model.load_state_dict(global_state)
            accuracy.append(evaluate_model(model, data.server_test.x, data.server_test.y,
                                           "cross_entropy", cfg["eval.batch_size"])["acc"])
        clock.tick()
        if until_acc is not None and accuracy and accuracy[-1] >= until_acc:
            break
    return RoundTimes(*clock.rounds(), global_state, "plain", accuracy)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def interleave(runs: dict[str, Callable[[], RoundTimes]], reps: int,
               warmup: bool = True) -> dict[str, list[RoundTimes]]:
    """Run each measurement `reps` times, alternating, so machine noise hits all alike.

    A first, unrecorded pass (`warmup`) keeps one-off costs (first kernel calls, lazy
    imports, allocator growth) out of whichever measurement happens to run first.
    """
    if warmup:
        for fn in runs.values():
            fn()
    out: dict[str, list[RoundTimes]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            out[name].append(fn())
    return out


def best(results: list[RoundTimes]) -> RoundTimes:
    """The repetition with the lowest steady-state round time (the least disturbed one)."""
    return min(results, key=lambda r: r.steady)


def report(workload: str, results: dict[str, list[RoundTimes]], reference: str = "plain",
           primary: str = "fedcore") -> dict[str, float]:
    """Print one line per measurement and, last, the primary ratio line."""
    ref = best(results[reference])
    out, ratios = {}, {}
    spread: dict[str, tuple[float, float]] = {}   # min and max of each repetition's ratio
    for name, reps in results.items():
        b = best(reps)
        if "processes" in name:   # its work is in other processes: only wall time compares
            wall_ref = min(r.steady_wall for r in results[reference])
            b = min(reps, key=lambda r: r.steady_wall)
            out[name], ratios[name] = b.steady_wall, b.steady_wall / wall_ref
            print(f"{workload} {name:>12}: first round {b.wall_rounds[0]:.4f} s, steady "
                  f"{b.steady_wall:.5f} s/round wall (best of {len(reps)}), x{ratios[name]:.3f} "
                  f"of {reference}'s wall {wall_ref:.5f}")
            continue
        out[name], ratios[name] = b.steady, b.steady / ref.steady
        paired = [r.steady / q.steady for r, q in zip(reps, results[reference])]
        spread[name] = (min(paired), max(paired))
        print(f"{workload} {name:>12}: first round {b.first:.4f} s, steady {b.steady:.5f} s/round "
              f"{CLOCK} (wall {b.steady_wall:.5f}; median of rounds 2..{len(b.rounds)}, best of "
              f"{len(reps)}), x{ratios[name]:.3f} of {reference} (repetition by repetition "
              f"x{spread[name][0]:.3f}-{spread[name][1]:.3f})")
    if primary not in results:   # e.g. only the vectorized executor was asked for
        primary = next(name for name in results if name != reference)
    p = best(results[primary])
    extra = "".join(f" {name}_s_per_round={out[name]:.6f} {name}_ratio={ratios[name]:.3f}"
                    + (f" {name}_ratio_range={spread[name][0]:.3f}-{spread[name][1]:.3f}"
                       if name in spread else "")
                    for name in results if name not in (primary, reference))
    if any("processes" in name for name in results):
        extra += f" plain_wall_s_per_round={min(r.steady_wall for r in results[reference]):.6f}"
    rng = f" ratio_range={spread[primary][0]:.3f}-{spread[primary][1]:.3f}" if primary in spread else ""
    print(f"fedcore_s_per_round={p.steady:.6f} plain_s_per_round={ref.steady:.6f} "
          f"ratio={p.steady / ref.steady:.3f}{rng}{extra} clock={CLOCK}")
    return out


def compare_with_plain(workload: str, config: Callable[[str], Any], data, executors: str,
                       reps: int) -> None:
    """Run the plain loop and fedcore under each executor, alternating; print how far each
    final model is from the plain loop's, then the timing lines (`report`)."""
    runs = {"plain": lambda: run_plain(config("sequential"), data)}
    for ex in executors.split(","):
        runs["fedcore" if ex == "sequential" else f"fedcore-{ex}"] = (
            lambda ex=ex: run_fedcore(config(ex), data))
    results = interleave(runs, reps)
    ref = results["plain"][0].final_state
    for name, results_of in results.items():
        print(f"{workload} {name:>12}: final model max |diff| vs plain = "
              f"{max_abs_diff(results_of[0].final_state, ref):.2e}")
    report(workload, results)
