"""W1 overhead: 1000 clients x 10 samples, 100 per round, logistic regression 784->10,
one SGD step (batch 10, lr 0.05) per client, 5 rounds.

    python -m bench.w1_overhead [--reps 5] [--threads 1] [--executors sequential,vectorized]

Prints each measurement, then `fedcore_s_per_round=... plain_s_per_round=... ratio=...`
(sequential executor against the plain loop) as its last line.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import bench_cfg, bench_data, compare_with_plain


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
    compare_with_plain("W1", config, bench_data(1000, 10, seed=0), a.executors, a.reps)


if __name__ == "__main__":
    main()
