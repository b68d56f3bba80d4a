"""What a deployed server's snapshot costs per round: bytes on disk and seconds to write.

Builds a course's server half (aggregator, sampler, monitor) for each model, then writes
its snapshot with `fedcore.runtime.snapshot.write_snapshot` (temp file, fsync, rename, fsync of the
folder, `latest` pointer) `--repeats` times into a temporary folder on the disk of `--dir`,
and prints the file's size and the median write time.

    python -m bench.snapshot_cost --dir /tmp
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from fedcore.runtime.snapshot import write_snapshot

MODELS = {
    "logreg, 8 features x 3 classes (the tests' model)": {"model.type": "logreg"},
    "mlp 784-1024-1024-10 (1.9 M parameters)": {"model.type": "mlp", "model.hidden": [1024, 1024],
                                                 "data.synthetic.dim": 784, "data.synthetic.num_classes": 10},
}


def measure(extra: dict, folder: Path, repeats: int) -> tuple[int, float]:
    cfg = load_config(None, extra={"seed": 0, "verbose": False, "federate.client_num": 3,
                                   "data.type": "synthetic", "data.synthetic.samples_per_client": 10,
                                   "data.synthetic.dim": 8, "data.synthetic.num_classes": 3, **extra})
    course = Course(cfg, folder).build()
    state = course.checkpointer.state(course.server)
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        path = write_snapshot(state, folder / "checkpoints", i + 1, keep=2)
        times.append(time.perf_counter() - t)
    return path.stat().st_size, statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (its disk is measured)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    for name, extra in MODELS.items():
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            size, seconds = measure(extra, Path(d), args.repeats)
        print(f"{name}: {size:,} bytes, {seconds * 1000:.1f} ms per snapshot (median of {args.repeats})")


if __name__ == "__main__":
    main()
