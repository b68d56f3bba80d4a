"""W2 compute: 100 clients x 100 samples, all 100 per round, LeNet-5, one local epoch of
SGD (batch 32, lr 0.05), 5 rounds.

    python -m bench.w2_compute [--reps 2] [--threads 1] [--executors sequential]

Prints each measurement, then `fedcore_s_per_round=... plain_s_per_round=... ratio=...`
(sequential executor against the plain loop) as its last line.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import bench_cfg, bench_data, compare_with_plain


def config(executor: str = "sequential", rounds: int = 5):
    return bench_cfg(**{
        "federate.client_num": 100, "federate.total_round_num": rounds, "model.type": "lenet5",
        "train.local_epochs": 1, "train.batch_size": 32, "train.optimizer.lr": 0.05,
        "executor": executor})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--executors", default="sequential")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    compare_with_plain("W2", lambda ex: config(ex, a.rounds), bench_data(100, 100, seed=0),
                       a.executors, a.reps)


if __name__ == "__main__":
    main()
