"""W3 scale: 100,000 logical clients x 10 samples, 1,000 per round, logistic regression
with SCAFFOLD (per-client control variates) on the disk-backed state store, 3 rounds.

    python -m bench.w3_scale [--algorithm scaffold] [--clients 100000] [--per-round 1000] [--store disk]

Client data are generated on access from `seed + client_id`, so only the sampled
clients' shards exist at any time. Reports peak RSS, the state store's disk use and
seconds per round; last line `fedcore_s_per_round=... plain_s_per_round=... ratio=...`
(the plain loop is the same FedAvg work without a state store; it is only run for
`--algorithm fedavg`, where it is the identical computation).

SCAFFOLD must be registered (`algorithm.name=scaffold`); without it the script exits
with status 2 and says so. `--algorithm fedavg` measures the same scale with FedAvg,
whose only per-client state is each client's mini-batch stream position.
"""
from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile

import torch

from fedcore import registry
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
    p.add_argument("--algorithm", default="scaffold")
    p.add_argument("--clients", type=int, default=100_000)
    p.add_argument("--per-round", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--executor", default="sequential")
    p.add_argument("--store", choices=("disk", "memory"), default="disk",
                   help="the state store (W3 is defined on disk; memory shows what the disk costs)")
    a = p.parse_args(argv)
    if a.algorithm not in registry.algorithms:
        print(f"W3: algorithm '{a.algorithm}' is not registered in this installation "
              f"(known: {', '.join(registry.algorithms.names())}); W3 needs SCAFFOLD's per-client "
              "control variates. Run with --algorithm fedavg to measure the same scale with "
              "FedAvg's per-client state (mini-batch stream positions) only.", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    data = bench_data(a.clients, 10, seed=0, lazy=True)
    path = tempfile.mkdtemp(prefix="fedcore-w3-")
    try:
        cfg = config(a.algorithm, a.clients, a.per_round, a.rounds, path, a.executor, a.store)
        fed = run_fedcore(cfg, data)
        rss = peak_rss_mb()
        disk = sum(f.stat().st_size for f in __import__("pathlib").Path(path).glob("client_*.pt"))
        files = len(list(__import__("pathlib").Path(path).glob("client_*.pt")))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    print(f"W3 {a.algorithm} ({a.executor}, {a.store} store): {a.clients:,} clients, {a.per_round:,} per round, "
          f"{a.rounds} rounds: first round {fed.first:.2f} s, steady {fed.steady:.3f} s/round "
          f"(cpu; wall {fed.steady_wall:.3f}), peak RSS {rss:.0f} MB "
          f"(target < 3072 MB: {'met' if rss < 3072 else 'MISSED'}), state store on disk "
          f"{disk / 1e6:.1f} MB in {files:,} files")
    if a.algorithm == "fedavg":
        plain = run_plain(cfg, data)
        print(f"W3 final model max |diff| vs plain = {max_abs_diff(fed.final_state, plain.final_state):.2e}")
        print(f"fedcore_s_per_round={fed.steady:.6f} plain_s_per_round={plain.steady:.6f} "
              f"ratio={fed.steady / plain.steady:.3f} peak_rss_mb={rss:.0f} disk_mb={disk / 1e6:.1f}")
    else:
        print(f"fedcore_s_per_round={fed.steady:.6f} plain_s_per_round=nan ratio=nan "
              f"peak_rss_mb={rss:.0f} disk_mb={disk / 1e6:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
