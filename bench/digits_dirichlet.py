"""Check the digits scenario's promise: >= 0.90 test accuracy in under a minute.

    python bench/digits_dirichlet.py [KEY=VALUE ...]

Runs scenarios/digits_dirichlet.yaml with torch on one thread (small models
only lose time to intra-op threads), prints accuracy and wall time, and
exits 1 when either target is missed.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "digits_dirichlet.yaml"


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(SCENARIO, [f"outdir={out}", "verbose=false", *argv])
        summary = Course(cfg).run()
    wall = time.perf_counter() - start
    acc = summary["final_test_acc"]
    print(f"digits_dirichlet: {cfg['federate.client_num']} clients, alpha {cfg['data.alpha']}, "
          f"{summary['rounds']} rounds: test_acc {acc:.4f} (round {summary.get('rounds_to_target')} "
          f"reached {cfg['eval.target_acc']}), {wall:.1f}s wall including data loading")
    return 0 if acc >= 0.90 and wall < 60 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
