"""W1 overhead: 1000 clients x 10 samples, 100 per round, logistic regression 784->10,
one SGD step (batch 10, lr 0.05) per client, 5 rounds.

    python -m bench.w1_overhead [--reps 5] [--threads 1] [--executors sequential,vectorized]

Prints each measurement, then `fedcore_s_per_round=... plain_s_per_round=... ratio=...`
(sequential executor against the plain loop) as its last line.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import bench_cfg, bench_data, interleave, max_abs_diff, report, run_fedcore, run_plain


def config(executor: str = "sequential"):
    return bench_cfg(**{
        "federate.client_num": 1000, "federate.sample_client_num": 100,
        "federate.total_round_num": 5, "model.type": "logreg",
        "train.local_steps": 1, "train.batch_size": 10, "train.optimizer.lr": 0.05,
        "executor": executor})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--executors", default="sequential,vectorized")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    data = bench_data(1000, 10, seed=0)
    runs = {"plain": lambda: run_plain(config(), data)}
    for ex in a.executors.split(","):
        runs["fedcore" if ex == "sequential" else f"fedcore-{ex}"] = (
            lambda ex=ex: run_fedcore(config(ex), data))
    results = interleave(runs, a.reps)
    ref = results["plain"][0].final_state
    for name, reps in results.items():
        print(f"W1 {name:>12}: final model max |diff| vs plain = "
              f"{max_abs_diff(reps[0].final_state, ref):.2e}")
    report("W1", results)


if __name__ == "__main__":
    main()
