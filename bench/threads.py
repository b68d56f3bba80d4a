"""Where intra-op threads pay: one local training step (forward, backward, SGD) of zoo models
of growing size, timed with one thread and with every usable core, in one process; then
whole courses with the default (`torch_threads: auto`) against one thread, on the machine as
it is and beside a busy neighbour.

    python -m bench.threads [--seconds 1.0] [--rounds 4] [--skip-steps] [--course mlp|p1]

Prints one line per model (its step's MFLOP as `torch_threads: auto` counts them, the time per
step with each thread count, their ratio); then, for a sequential course whose step auto gives
every core (an MLP 3072 -> 1024 -> 10, batch 32: ~600 MFLOP a step; `--course p1`: P1's, the
CIFAR10-shaped CNN with dropout of bench/peers.py, ~900 MFLOP a step), its wall seconds per round
(after the first) with `torch_threads: auto` and with 1, each course a fresh `fedcore.run`
process (so OpenMP starts with the wait policy fedcore sets), without and then with a second
process spinning on a core. The last line is `threshold_mflop=... smallest_gain_mflop=...
largest_loss_mflop=... default_over_one_idle=... default_over_one_busy=...`: auto's threshold,
the smallest step that ran faster on every core, the largest that ran slower, and the courses'
ratios (auto's seconds per round over one thread's; "idle" is the machine as it is, whose
load average each line states).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


COURSE = {"seed": 0, "verbose": False,
          "federate": {"client_num": 4, "sample_client_num": 4},
          "data": {"type": "synthetic", "partition": "natural",
                   "synthetic": {"samples_per_client": 320, "dim": 3072, "num_classes": 10}},
          "model": {"type": "mlp", "hidden": [1024]},
          "train": {"batch_size": 32, "local_steps": 10, "optimizer": {"lr": 0.01}},
          "eval": {"clients": False, "freq": 10_000}}


def course_seconds_per_round(threads, rounds: int, tmp: Path, tag: str) -> float:
    """Wall seconds per round after the first of COURSE run by `python -m fedcore.run` with
    `torch_threads` set to `threads`, in a process of its own."""
    cfg, out = tmp / "course.yaml", tmp / f"run_{tag}"
    cfg.write_text(json.dumps({**COURSE, "federate": {**COURSE["federate"], "total_round_num": rounds}}))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    subprocess.run([sys.executable, "-m", "fedcore.run", "--cfg", str(cfg), f"outdir={out}",
                    f"torch_threads={threads}"], check=True, env=env, stdout=subprocess.DEVNULL)
    walls = [json.loads(x)["wall_time"] for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return (walls[-1] - walls[0]) / (len(walls) - 1)


def p1_seconds_per_round(threads, rounds: int, tmp: Path, tag: str) -> float:
    """Wall seconds per round after the first of P1's sequential course (bench/peers.py: pfl's
    CIFAR10 shape, dropout on, 50 users a round of 1000) with `torch_threads` set to `threads`,
    in a process of its own (`--p1-child`), as `course_seconds_per_round` runs COURSE."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-m", "bench.threads", "--p1-child", str(threads),
                          "--rounds", str(rounds)], check=True, env=env, capture_output=True, text=True)
    walls = json.loads(out.stdout.strip().splitlines()[-1])
    return sum(walls[1:]) / (len(walls) - 1)


def _p1_child(threads: str, rounds: int) -> None:
    """In a fresh process (OpenMP starts with the wait policy fedcore sets): P1's course, then
    each round's wall seconds as one JSON line."""
    from bench.common import run_fedcore
    from bench.peers import workload_cfg, workload_data
    cfg = workload_cfg("p1", 1000, rounds, "cpu", torch_threads=threads if threads == "auto" else int(threads))
    times = run_fedcore(cfg, workload_data("p1", 1000, dtype=cfg["model.dtype"]))
    print(json.dumps(times.wall_rounds), flush=True)


def compare_courses(rounds: int, busy: bool, course: str = "mlp") -> float:
    """auto's seconds per round over one thread's (each run twice, alternately; best of two)."""
    seconds = p1_seconds_per_round if course == "p1" else course_seconds_per_round
    neighbour = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            times: dict[str, list[float]] = {"auto": [], "1": []}
            for k in range(2):
                for threads in times:
                    times[threads].append(seconds(threads, rounds, Path(tmp), f"{threads}_{k}"))
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    auto, one = min(times["auto"]), min(times["1"])
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    print(f"{course} course {'beside a busy neighbour' if busy else 'as the machine is'} (load average {load}): "
          f"torch_threads auto {auto:.2f} s/round, 1 thread {one:.2f} s/round, ratio {auto / one:.2f}",
          flush=True)
    return auto / one


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0, help="timing per model and thread count")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each course (the first not timed)")
    p.add_argument("--skip-steps", action="store_true", help="only the courses")
    p.add_argument("--course", choices=("mlp", "p1"), default="mlp",
                   help="the courses compared: the MLP above, or P1's (bench/peers.py)")
    p.add_argument("--p1-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.p1_child is not None:
        _p1_child(a.p1_child, a.rounds)
        return
    cores = usable_cores()
    print(f"{cores} usable cores, torch {torch.__version__}; best of two timings each")
    gains, losses = [], []
    for kind, shape, batch, extra in ([] if a.skip_steps else MODELS):
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
    idle, busy = compare_courses(a.rounds, False, a.course), compare_courses(a.rounds, True, a.course)
    print(f"threshold_mflop={AUTO_THREADS_MFLOP:g} "
          f"smallest_gain_mflop={min(gains) if gains else float('nan'):.3g} "
          f"largest_loss_mflop={max(losses) if losses else float('nan'):.3g} "
          f"default_over_one_idle={idle:.2f} default_over_one_busy={busy:.2f}")


if __name__ == "__main__":
    main()
