"""Accuracy against bytes sent for each update compression, on one image course.

    python bench/compression_figures.py [KEY=VALUE ...]

Runs scenarios/digits_dirichlet.yaml (scikit-learn's 8x8 handwritten digits, 30
clients, Dirichlet(0.5) label skew, an MLP) once per `compress.*` setting below and
prints a Markdown table: final test accuracy, the clients' upload (`bytes_up` summed
over rounds, what the wire carried) and its ratio to uncompressed FedAvg in the same
run. The figures in docs/compression.md come from this script.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from fedcore.config import load_config
from fedcore.course import Course

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "digits_dirichlet.yaml"

SETTINGS = [
    ("none", []),
    ("int8", ["compress.type=int8"]),
    ("int4", ["compress.type=int4"]),
    ("int4 + error feedback", ["compress.type=int4", "compress.error_feedback=true"]),
    ("top-k 10%", ["compress.type=topk", "compress.topk_fraction=0.1"]),
    ("top-k 1%", ["compress.type=topk", "compress.topk_fraction=0.01"]),
    ("top-k 10%, no error feedback", ["compress.type=topk", "compress.topk_fraction=0.1",
                                      "compress.error_feedback=false"]),
]


def run(keys: list[str], extra: list[str]) -> tuple[float, int, float]:
    """(final test accuracy, total bytes up, wall seconds) of one course."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(SCENARIO, [f"outdir={out}", "verbose=false", *keys, *extra])
        summary = Course(cfg).run()
    return summary["final_test_acc"], summary["bytes_up"], time.perf_counter() - start


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    print("| compression | final test acc | bytes up (total) | of uncompressed | wall s |")
    print("|---|---|---|---|---|")
    base = None
    for label, keys in SETTINGS:
        acc, up, wall = run(keys, argv)
        base = base or up
        print(f"| {label} | {acc:.4f} | {up:,} | {up / base:.3f} | {wall:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
