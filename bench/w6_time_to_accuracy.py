"""W6 time to accuracy: 1000 clients x 100 images, 100 per round, LeNet-5, one local epoch
of SGD (batch 32, lr 0.05), FedAvg, evaluated every round, until a target test accuracy.

    python -m bench.w6_time_to_accuracy [--target 0.9] [--reps 2] [--executors sequential,vectorized,processes]

Each measurement (the plain loop, then fedcore under each executor) runs in its own
process, so its peak RSS is its own; repetitions alternate between them. The time to
target is wall seconds from building the course (or the plain loop's model) to the
record of the first round whose accuracy reaches the target; the start-up is part of
it. CPU seconds are printed beside (they compare on a shared machine; not for
`processes`, whose work is in its workers). Prints each measurement, then as its last
line `plain_s_to_target=...` and, per executor, `<executor>_s_to_target=...
<executor>_ratio=...` (fedcore over plain, wall) and `<executor>_cpu_ratio=...`.
The images are each class's smooth pattern under Gaussian noise, made on access from
`seed + client_id` (`bench.common.image_shard`).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import torch

from bench.common import bench_cfg, bench_data, max_abs_diff, run_fedcore, run_plain


def config(executor: str, clients: int, samples: int, per_round: int, max_rounds: int):
    return bench_cfg(**{
        "federate.client_num": clients, "federate.sample_client_num": per_round,
        "federate.total_round_num": max_rounds, "model.type": "lenet5",
        "train.local_epochs": 1, "train.batch_size": 32, "train.optimizer.lr": 0.05,
        "eval.freq": 1, "executor": executor})


def _rss_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0   # Linux: KiB


def measure_one(name: str, a) -> dict:
    """One run in this process: the plain loop (`plain`) or fedcore under executor `name`."""
    torch.set_num_threads(a.threads)
    data = bench_data(a.clients, a.samples, seed=0, test_n=a.test_samples, lazy=True, images=True)
    cfg = config("sequential" if name == "plain" else name, a.clients, a.samples, a.per_round,
                 a.max_rounds)
    run = run_plain(cfg, data, until_acc=a.target) if name == "plain" else \
        run_fedcore(cfg, data, until_acc=a.target)
    acc = run.accuracy[-1] if run.accuracy else 0.0
    if a.save:
        torch.save(run.final_state, a.save)
    return {"name": name, "wall_s": sum(run.wall_rounds), "cpu_s": sum(run.cpu_rounds),
            "rounds": len(run.wall_rounds), "acc": acc, "reached": acc >= a.target,
            "rss_mb": _rss_mb(resource.RUSAGE_SELF),
            "children_rss_mb": _rss_mb(resource.RUSAGE_CHILDREN)}


def _spawn(name: str, a, save: str) -> dict:
    args = [sys.executable, "-m", "bench.w6_time_to_accuracy", "--one", name, "--save", save,
            "--target", str(a.target), "--clients", str(a.clients), "--samples", str(a.samples),
            "--per-round", str(a.per_round), "--max-rounds", str(a.max_rounds),
            "--test-samples", str(a.test_samples), "--threads", str(a.threads)]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"W6 {name}: the measurement failed:\n{proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--executors", default="sequential,vectorized,processes")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--samples", type=int, default=100, help="training images per client")
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--max-rounds", type=int, default=100, help="give up after this many rounds")
    p.add_argument("--test-samples", type=int, default=2000, help="the server's test images")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)   # a single measurement
    p.add_argument("--save", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one is not None:
        print(json.dumps(measure_one(a.one, a)))
        return 0
    names = ["plain"] + [e for e in a.executors.split(",") if e]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="fedcore-w6-") as tmp:
        for rep in range(a.reps):
            for n in names:
                save = os.path.join(tmp, f"{n}.pt")
                runs[n].append(_spawn(n, a, save))
                r = runs[n][-1]
                print(f"W6 {n:>10} rep {rep + 1}: {r['wall_s']:.2f} s to {'target' if r['reached'] else 'NO target'} "
                      f"({r['rounds']} rounds, acc {r['acc']:.4f}), cpu {r['cpu_s']:.2f} s, "
                      f"peak RSS {r['rss_mb']:.0f} MB", flush=True)
        finals = {n: torch.load(os.path.join(tmp, f"{n}.pt"), weights_only=True) for n in names}
    best = {n: min(rs, key=lambda r: r["wall_s"]) for n, rs in runs.items()}
    plain = best["plain"]
    line = [f"plain_s_to_target={plain['wall_s']:.3f}", f"plain_cpu_s={plain['cpu_s']:.3f}",
            f"plain_rounds={plain['rounds']}"]
    for n in names:
        rs, b = runs[n], best[n]
        walls = [r["wall_s"] for r in rs]
        ratios = [r["wall_s"] / q["wall_s"] for r, q in zip(rs, runs["plain"])]
        same = "rounds differ" if b["rounds"] != plain["rounds"] else \
            f"final model max |diff| vs plain {max_abs_diff(finals[n], finals['plain']):.2e}"
        workers = f", largest worker {b['children_rss_mb']:.0f} MB" if b["children_rss_mb"] else ""
        cpu = "" if n == "processes" else f", cpu {b['cpu_s']:.2f} s (x{b['cpu_s'] / plain['cpu_s']:.3f})"
        print(f"W6 {n:>10}: {b['wall_s']:.2f} s to target acc {a.target}{cpu} (best of {len(rs)}; "
              f"{min(walls):.2f}-{max(walls):.2f}), {b['rounds']} rounds, x{b['wall_s'] / plain['wall_s']:.3f} "
              f"of plain (per repetition {min(ratios):.3f}-{max(ratios):.3f}), peak RSS "
              f"{b['rss_mb']:.0f} MB{workers}; {same}")
        if n != "plain":
            line += [f"{n}_s_to_target={b['wall_s']:.3f}", f"{n}_ratio={b['wall_s'] / plain['wall_s']:.3f}",
                     f"{n}_ratio_range={min(ratios):.3f}-{max(ratios):.3f}",
                     f"{n}_rounds={b['rounds']}", f"{n}_rss_mb={b['rss_mb']:.0f}"]
            if n != "processes":   # its work is in its workers: only its wall time compares
                line.append(f"{n}_cpu_ratio={b['cpu_s'] / plain['cpu_s']:.3f}")
    line.append(f"plain_rss_mb={plain['rss_mb']:.0f}")
    if not all(r["reached"] for rs in runs.values() for r in rs):
        print(f"W6: some runs did not reach {a.target} within {a.max_rounds} rounds", file=sys.stderr)
    print(" ".join(line) + " clock=wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
