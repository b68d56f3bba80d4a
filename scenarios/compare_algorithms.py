"""Compare client-drift algorithms with FedAvg: accuracy vs rounds, vs virtual time, vs bytes.

    python -m fedcore.scenarios.compare_algorithms [--algorithms fedprox scaffold ...]
        [--target 0.6] [--out runs/compare] [--markdown FILE] [KEY=VALUE ...]

Runs `scenarios/<name>.yaml` for each algorithm and, for each distinct
model/data/training setup among them, the same YAML with
`algorithm.name=fedavg` and no server optimizer as the baseline. Prints a
markdown report: the virtual time, rounds and bytes each run needed to reach
`--target` test accuracy; the accuracy at a common virtual-time budget and at a common byte
budget (the smaller totals of the algorithm and its baseline); and
accuracy per evaluated round. Every run's outputs (metrics.jsonl, summary.json) stay under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course

__all__ = ["main", "run_one", "report"]

HERE = Path(__file__).resolve().parent
DEFAULT = ["fedprox", "scaffold", "feddyn", "moon", "fedmos"]


def run_one(yaml_path: Path, outdir: Path, overrides: list[str]) -> list[dict]:
    """Run one course; return its per-round records with cumulative bytes added."""
    cfg = load_config(yaml_path, overrides, extra={"outdir": str(outdir), "verbose": False})
    Course(cfg, outdir).run()
    records = [json.loads(line) for line in (outdir / "metrics.jsonl").read_text().splitlines()]
    total = 0
    for r in records:
        total += r["bytes_up"] + r["bytes_down"]
        r["cum_bytes"] = total
    return records


# what makes a run's algorithm: the baseline resets these, runs differing only in them share it
ALGORITHM_SECTIONS = ("algorithm", "server_optimizer")
BASELINE = ["algorithm.name=fedavg", "server_optimizer.type=sgd", "server_optimizer.lr=1"]


def _baseline_key(yaml_path: Path, overrides: list[str]) -> str:
    """Runs whose config differs only in algorithm.* and server_optimizer.* keys share one
    FedAvg baseline."""
    cfg = load_config(yaml_path, overrides)
    tree = {k: v for k, v in cfg.as_tree().items()
            if k not in (*ALGORITHM_SECTIONS, "name", "outdir")}
    return json.dumps(tree, sort_keys=True, default=str)


def _first(records: list[dict], target: float) -> dict | None:
    return next((r for r in records if r.get("test_acc", -1) >= target), None)


def _acc_within(records: list[dict], field: str, budget: float) -> float | None:
    """Last evaluated accuracy whose `field` (virtual_time or cum_bytes) is within budget."""
    accs = [r["test_acc"] for r in records if "test_acc" in r and r[field] <= budget + 1e-9]
    return accs[-1] if accs else None


def _fmt(v, spec=".3f") -> str:
    return "—" if v is None else format(v, spec)


def _pair(a, b, spec=".3f") -> str:
    return f"{_fmt(a, spec)} ({_fmt(b, spec)})"


def _stats(rs: list[dict], target: float, t_budget: float, b_budget: float) -> dict:
    evals = [r["test_acc"] for r in rs if "test_acc" in r]
    hit = _first(rs, target)
    return {"final": evals[-1] if evals else None, "best": max(evals) if evals else None,
            "rounds": hit["round"] if hit else None, "time": hit["virtual_time"] if hit else None,
            "mb": hit["cum_bytes"] / 1e6 if hit else None,
            "at_time": _acc_within(rs, "virtual_time", t_budget),
            "at_bytes": _acc_within(rs, "cum_bytes", b_budget),
            "total_time": rs[-1]["virtual_time"], "total_mb": rs[-1]["cum_bytes"] / 1e6}


def report(runs: dict[str, list[dict]], target: float, baseline_of: dict[str, str]) -> str:
    """Markdown: each algorithm against its FedAvg baseline (in brackets), then accuracy by round.

    The common budgets of a pair are the smaller of the two runs' totals, so
    both runs are read at a point each of them reached.
    """
    lines = [f"Each cell: the algorithm (its FedAvg baseline on the same setup). Target test accuracy "
             f"{target:.2f}; '—': not reached.", "",
             "| algorithm | final acc | best acc | rounds to target | virtual s to target | MB to target "
             "| common virtual-time budget: acc @ s | common byte budget: acc @ MB | total virtual s "
             "| total MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, base in baseline_of.items():
        rs, rb = runs[label], runs[base]
        t = min(rs[-1]["virtual_time"], rb[-1]["virtual_time"])
        b = min(rs[-1]["cum_bytes"], rb[-1]["cum_bytes"])
        a, f = _stats(rs, target, t, b), _stats(rb, target, t, b)
        rounds = f"{a['rounds'] or '—'} ({f['rounds'] or '—'})"
        lines.append(
            f"| {label} | {_pair(a['final'], f['final'])} | {_pair(a['best'], f['best'])} | {rounds} "
            f"| {_pair(a['time'], f['time'], '.1f')} | {_pair(a['mb'], f['mb'], '.2f')} "
            f"| {_pair(a['at_time'], f['at_time'])} @ {t:.1f} s "
            f"| {_pair(a['at_bytes'], f['at_bytes'])} @ {b / 1e6:.2f} MB "
            f"| {_pair(a['total_time'], f['total_time'], '.1f')} "
            f"| {_pair(a['total_mb'], f['total_mb'], '.2f')} |")
    rounds = sorted({r["round"] for rs in runs.values() for r in rs if "test_acc" in r})
    lines += ["", "Test accuracy by round (virtual s, cumulative MB):", "",
              "| round | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for rnd in rounds:
        cells = []
        for rs in runs.values():
            r = next((x for x in rs if x["round"] == rnd and "test_acc" in x), None)
            cells.append("—" if r is None else
                         f"{r['test_acc']:.3f} ({r['virtual_time']:.1f} s, {r['cum_bytes'] / 1e6:.2f} MB)")
        lines.append(f"| {rnd} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", nargs="+", default=DEFAULT)
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--out", default="runs/compare")
    ap.add_argument("--markdown", default=None, help="also write the report to this file")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE applied to every run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)   # many tiny models: extra threads only contend
    out = Path(args.out)
    runs: dict[str, list[dict]] = {}
    baselines: dict[str, str] = {}       # setup -> its FedAvg run's label
    baseline_of: dict[str, str] = {}     # algorithm -> its FedAvg run's label
    for name in args.algorithms:
        yaml_path = HERE / f"{name}.yaml"
        runs[name] = run_one(yaml_path, out / name, args.overrides)
        key = _baseline_key(yaml_path, args.overrides)
        if key not in baselines:
            label = f"fedavg ({name} setup)" if baselines else "fedavg"
            baselines[key] = label
            runs[label] = run_one(yaml_path, out / f"fedavg_for_{name}", args.overrides + BASELINE)
        baseline_of[name] = baselines[key]
        print(f"done: {name}", file=sys.stderr)
    text = report(runs, args.target, baseline_of)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
