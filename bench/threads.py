"""Where intra-op threads pay: one local training step (forward, backward, SGD) of zoo models
of growing size, timed with one thread and with every usable core, in one process.

    python -m bench.threads [--seconds 1.0]

Prints one line per model (its step's MFLOP as `torch_threads: auto` counts them, the time per
step with each thread count, their ratio), then `threshold_mflop=... smallest_gain_mflop=...
largest_loss_mflop=...` as its last line: auto's threshold, the smallest step that ran faster
on every core, and the largest that ran slower.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from fedcore.execution.executor import AUTO_THREADS_MFLOP, usable_cores
from fedcore.kernel.config import load_config
from fedcore.scenarios.models import build_model

# (model.type, input shape, batch, extra keys): from P2's logistic regression to P1's CNN
MODELS = [
    ("logreg", (1, 28, 28), 10, {}),
    ("mlp", (1, 28, 28), 32, {"model.hidden": [32]}),
    ("mlp", (1, 28, 28), 32, {"model.hidden": [64]}),
    ("mlp", (1, 28, 28), 32, {"model.hidden": [128]}),
    ("mlp", (1, 28, 28), 64, {"model.hidden": [128]}),
    ("lenet5", (1, 28, 28), 32, {}),
    ("lenet5", (1, 28, 28), 64, {}),
    ("convnet2", (3, 32, 32), 10, {"model.convnet2_hidden": 128, "model.norm": "none"}),
]


def step_time(model, x, y, threads: int, seconds: float) -> float:
    """Seconds per step with `threads` intra-op threads (after three warm-up steps)."""
    torch.set_num_threads(threads)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for _ in range(3):
        step()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        n += 1
    return (time.perf_counter() - start) / n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0, help="timing per model and thread count")
    a = p.parse_args(argv)
    cores = usable_cores()
    print(f"{cores} usable cores, torch {torch.__version__}; best of two timings each")
    gains, losses = [], []
    for kind, shape, batch, extra in MODELS:
        cfg = load_config(None, extra={"seed": 0, "model.type": kind, **extra})
        model = build_model(cfg, shape, 10)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn((batch,) + shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
        with FlopCounterMode(display=False) as counter:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        mflop = counter.get_total_flops() / 1e6
        times = {t: min(step_time(model, x, y, t, a.seconds) for _ in range(2)) for t in (1, cores)}
        ratio = times[cores] / times[1]
        (gains if ratio < 1 else losses).append(mflop)
        print(f"{kind:9s} {str(shape):12s} batch {batch:3d} {mflop:9.2f} MFLOP  1 thread "
              f"{times[1] * 1e3:8.3f} ms  {cores} threads {times[cores] * 1e3:8.3f} ms  ratio {ratio:.2f}")
    print(f"threshold_mflop={AUTO_THREADS_MFLOP:g} "
          f"smallest_gain_mflop={min(gains) if gains else float('nan'):.3g} "
          f"largest_loss_mflop={max(losses) if losses else float('nan'):.3g}")


if __name__ == "__main__":
    main()
