"""W3 scale: 1,000,000 logical clients x 10 samples, 1,000 per round, logistic regression
with SCAFFOLD (per-client control variates) on the disk-backed state store, 3 rounds.

    python -m bench.w3_scale [--algorithm scaffold] [--clients 1000000] [--per-round 1000] [--store disk]

Client data are generated on access from `seed + client_id`, so only the sampled
clients' shards exist at any time. Reports peak RSS, the state store's disk use and
seconds per round; last line `fedcore_s_per_round=... plain_s_per_round=... ratio=...`.

The plain loop (`bench.common.run_plain`) does the identical SCAFFOLD computation and
keeps each client's control variate in a dict in memory, as a hand-written loop
would; its final model must equal fedcore's. `--store memory` runs fedcore with the
same in-memory keeping, which isolates what the disk costs. `--algorithm fedavg`
measures the same scale with FedAvg (per-client state: mini-batch stream positions).
"""
from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import fedcore.algorithms  # noqa: F401  (registers the algorithms named on the command line)
from fedcore.kernel import registry
from bench.common import bench_cfg, bench_data, max_abs_diff, run_fedcore, run_plain


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux: KiB


def config(algorithm: str, clients: int, per_round: int, rounds: int, path: str,
           executor: str = "sequential", store: str = "disk"):
    return bench_cfg(**{
        "federate.client_num": clients, "federate.sample_client_num": per_round,
        "federate.total_round_num": rounds, "model.type": "logreg", "algorithm.name": algorithm,
        "train.local_steps": 1, "train.batch_size": 10, "train.optimizer.lr": 0.05,
        "state.store": store, "state.path": path, "executor": executor})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="scaffold", choices=("scaffold", "fedavg"))
    p.add_argument("--clients", type=int, default=1_000_000)
    p.add_argument("--per-round", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--executor", default="sequential")
    p.add_argument("--store", choices=("disk", "memory"), default="disk",
                   help="the state store (W3 is defined on disk; memory shows what the disk costs)")
    p.add_argument("--state-dir", default=None,
                   help="folder in which the disk store's folder is made (default: the system's "
                        "temporary folder); file creation speed differs between file systems")
    a = p.parse_args(argv)
    if a.algorithm not in registry.algorithms:
        print(f"W3: algorithm '{a.algorithm}' is not registered "
              f"(known: {', '.join(registry.algorithms.names())})", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    data = bench_data(a.clients, 10, seed=0, lazy=True)
    path = tempfile.mkdtemp(prefix="fedcore-w3-", dir=a.state_dir)
    try:
        cfg = config(a.algorithm, a.clients, a.per_round, a.rounds, path, a.executor, a.store)
        built = []
        start = time.perf_counter()
        fed = run_fedcore(cfg, data, before_run=lambda course: built.append(time.perf_counter() - start))
        rss = peak_rss_mb()
        files = [f for f in Path(path).iterdir() if f.is_file()]
        disk = sum(f.stat().st_size for f in files)
        files = len(files)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    print(f"W3 {a.algorithm} ({a.executor}, {a.store} store): {a.clients:,} clients, {a.per_round:,} per round, "
          f"{a.rounds} rounds: building the course {built[0]:.2f} s wall, first round (building, "
          f"{a.clients:,} joins, round 1) {fed.first:.2f} s (wall {fed.wall_rounds[0]:.2f}), steady {fed.steady:.3f} s/round "
          f"(cpu; wall {fed.steady_wall:.3f}), peak RSS {rss:.0f} MB "
          f"(target < 3072 MB: {'met' if rss < 3072 else 'MISSED'}), state store on disk "
          f"{disk / 1e6:.1f} MB in {files:,} files under {Path(path).parent}")
    plain = run_plain(cfg, data)
    print(f"W3 plain loop: first round {plain.first:.2f} s, steady {plain.steady:.3f} s/round (cpu; "
          f"wall {plain.steady_wall:.3f}); final model max |diff| vs fedcore = "
          f"{max_abs_diff(fed.final_state, plain.final_state):.2e}")
    print(f"fedcore_s_per_round={fed.steady:.6f} plain_s_per_round={plain.steady:.6f} "
          f"ratio={fed.steady / plain.steady:.3f} peak_rss_mb={rss:.0f} disk_mb={disk / 1e6:.1f} "
          f"files={files} first_round_s={fed.wall_rounds[0]:.2f} first_round_cpu_s={fed.cpu_rounds[0]:.2f} "
          f"build_s={built[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
