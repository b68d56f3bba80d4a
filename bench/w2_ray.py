"""W2 on Ray: W2's course (100 clients x 100 samples, all per round, LeNet-5, one local
epoch of SGD, batch 32, lr 0.05) under `executor: ray`, `processes` and `sequential`, the
first two with the same number of CPUs (one per actor, one per worker process).

    python -m bench.w2_ray [--cpus 2] [--rounds 5] [--reps 2]

Ray's actors build the course from its config, so the data here come from the config too:
`data.type: bench_w2` is W2's data (the same per-client shards as `bench.common.bench_data`)
registered by this module, which the config lists under `plugins` so every actor imports it.
The times compared are wall seconds per round after the first (the first holds the start of
the worker processes or actors). Prints each measurement, then `ray_s_per_round=...
processes_s_per_round=... sequential_s_per_round=... ray_over_processes=...` as its last line.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

import numpy as np
import torch

from bench.common import (NUM_CLASSES, RoundTimes, _teacher, bench_cfg, client_shard,
                          max_abs_diff, run_fedcore)
from fedcore.kernel import registry
from fedcore.scenarios.data import RawDataset

CLIENTS, SAMPLES = 100, 100


def w2_raw(cfg) -> RawDataset:
    """W2's client shards as one dataset whose natural groups are the clients."""
    seed = cfg["seed"]
    teacher = _teacher(seed)
    shards = [client_shard(seed, cid, SAMPLES, teacher) for cid in range(1, CLIENTS + 1)]
    test = client_shard(seed, 10_000_000, 500, teacher)
    return RawDataset(torch.cat([s.x for s in shards]), torch.cat([s.y for s in shards]),
                      NUM_CLASSES, np.repeat(np.arange(CLIENTS), SAMPLES), test)


if "bench_w2" not in registry.datasets:
    registry.datasets.register("bench_w2", w2_raw)


def config(executor: str, cpus: int, rounds: int):
    return bench_cfg(**{
        "plugins": ["bench.w2_ray"], "data.type": "bench_w2", "data.partition": "natural",
        "federate.client_num": CLIENTS, "federate.total_round_num": rounds,
        "model.type": "lenet5", "train.local_epochs": 1, "train.batch_size": 32,
        "train.optimizer.lr": 0.05, "executor": executor, "executor_workers": cpus,
        "executor.ray.num_cpus": 1.0})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpus", type=int, default=2, help="actors = worker processes = CPUs")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    import ray
    # Ray's workers start in this environment: they import this module (the dataset) from here.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=a.cpus, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        results: dict[str, list[RoundTimes]] = {"sequential": [], "processes": [], "ray": []}
        for _ in range(a.reps):      # alternating, so machine noise hits all alike
            for ex in results:
                results[ex].append(run_fedcore(config(ex, a.cpus, a.rounds), None))
    finally:
        ray.shutdown()
    ref = results["sequential"][0].final_state
    steady = {}
    for ex, runs in results.items():
        diff = max_abs_diff(runs[0].final_state, ref)
        best = min(runs, key=lambda r: statistics.median(r.wall_rounds[1:]))
        steady[ex] = statistics.median(best.wall_rounds[1:])
        print(f"W2 {ex:>10}: first round {best.wall_rounds[0]:.2f} s, steady {steady[ex]:.3f} "
              f"s/round wall (median of rounds 2..{len(best.wall_rounds)}, best of {a.reps}); "
              f"final model max |diff| vs sequential {diff:.1e}")
    ratio = steady["ray"] / steady["processes"]
    print(f"W2 at {a.cpus} CPUs: ray / processes = {ratio:.3f}x (goal <= 1.2x), "
          f"processes speed-up over sequential {steady['sequential'] / steady['processes']:.2f}x, "
          f"ray's {steady['sequential'] / steady['ray']:.2f}x")
    print(f"ray_s_per_round={steady['ray']:.4f} processes_s_per_round={steady['processes']:.4f} "
          f"sequential_s_per_round={steady['sequential']:.4f} ray_over_processes={ratio:.3f} "
          f"cpus={a.cpus}")


if __name__ == "__main__":
    sys.exit(main())
