"""Accuracy (or perplexity) against bytes sent for each update compression, on one image
course and one language course.

    python bench/compression_figures.py [--course image|language] [KEY=VALUE ...]

`image` (the default) runs scenarios/digits_dirichlet.yaml (scikit-learn's 8x8 handwritten
digits, 30 clients, Dirichlet(0.5) label skew, an MLP); `language` runs
scenarios/llm_lora.yaml (a tiny GPT-2-style decoder, four authors as clients, rank-8 LoRA
adapters, exact aggregation), where what is compressed is the adapters each client sends.
Each course runs once per `compress.*` setting below; the script prints a Markdown table:
the final test accuracy (image) or the final test perplexity and next-token accuracy
(language), the clients' upload (`bytes_up` summed over rounds, what the wire carried) and
its ratio to the uncompressed course in the same run. The figures in docs/compression.md
come from this script.
"""
from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
COURSES = {"image": SCENARIOS / "digits_dirichlet.yaml", "language": SCENARIOS / "llm_lora.yaml"}

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


def run(scenario: Path, keys: list[str], extra: list[str]) -> tuple[dict, int, float]:
    """(the last evaluation's record, total bytes up, wall seconds) of one course."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(scenario, [f"outdir={out}", "verbose=false", *keys, *extra])
        summary = Course(cfg).run()
    return summary["final"], summary["bytes_up"], time.perf_counter() - start


def main(argv: list[str]) -> int:
    course = "image"
    if argv[:1] == ["--course"]:
        if len(argv) < 2 or argv[1] not in COURSES:
            print(f"--course takes one of {sorted(COURSES)}", file=sys.stderr)
            return 2
        course, argv = argv[1], argv[2:]
    torch.set_num_threads(1)
    if course == "image":
        print("| compression | final test acc | bytes up (total) | of uncompressed | wall s |")
        print("|---|---|---|---|---|")
    else:
        print("| compression | final test perplexity | next-token acc | bytes up (total) "
              "| of uncompressed | wall s |")
        print("|---|---|---|---|---|---|")
    base = None
    for label, keys in SETTINGS:
        final, up, wall = run(COURSES[course], keys, argv)
        base = base or up
        if course == "image":
            scores = f"{final['test_acc']:.4f}"
        else:
            scores = f"{math.exp(final['test_loss']):.3f} | {final['test_acc']:.4f}"
        print(f"| {label} | {scores} | {up:,} | {up / base:.3f} | {wall:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
