"""W1 and W2 on a CUDA GPU: fedcore with `device: cuda` (sequential and vectorized executors)
against the plain PyTorch loop doing identical work on the CPU and on the GPU.

    python -m bench.gpu [--workloads W1,W2] [--reps 2]

The plain GPU loop gets the data already on the GPU, as fedcore keeps them when they fit.
Times are wall seconds per round after the first (GPU work is asynchronous: CPU seconds
would not count it); each step's `loss.item()` waits for the GPU in every loop alike.
Prints each measurement, then `W2_vectorized_speedup_over_plain_cpu=...` (the goal is >= 10)
and the other ratios as its last line. Exits 2 with one line where torch sees no GPU.
"""
from __future__ import annotations

import argparse
import sys

import torch

import bench.common as common
from bench import w1_overhead, w2_compute
from bench.common import bench_data, interleave, max_abs_diff, run_fedcore, run_plain
from fedcore.runtime.device import place_data

WORKLOADS = {"W1": (w1_overhead.config, lambda: bench_data(1000, 10, seed=0)),
             "W2": (w2_compute.config, lambda: bench_data(100, 100, seed=0))}


def measure(name: str, reps: int) -> dict[str, float]:
    config, make_data = WORKLOADS[name]
    data = make_data()
    cuda = torch.device("cuda")
    gpu_data = place_data(data, cuda, None)

    def on_cuda(executor: str):
        return config(executor).with_overrides(device="cuda")
    runs = {"plain-cpu": lambda: run_plain(config("sequential"), data),
            "plain-gpu": lambda: run_plain(config("sequential"), gpu_data, device="cuda"),
            "fedcore-cuda": lambda: run_fedcore(on_cuda("sequential"), data),
            "fedcore-cuda-vectorized": lambda: run_fedcore(on_cuda("vectorized"), data)}
    results = interleave(runs, reps)
    ref = results["plain-cpu"][0].final_state
    steady = {}
    for label, out in results.items():
        best = min(out, key=lambda r: r.steady_wall)
        steady[label] = best.steady_wall
        diff = max_abs_diff({k: v.cpu() for k, v in out[0].final_state.items()}, ref)
        print(f"{name} {label:>24}: steady {best.steady_wall:.5f} s/round wall (best of {reps}), "
              f"final model max |diff| vs plain-cpu {diff:.1e}")
    return {f"{name}_{label}_s_per_round": s for label, s in steady.items()} | {
        f"{name}_vectorized_speedup_over_plain_cpu": steady["plain-cpu"] / steady["fedcore-cuda-vectorized"],
        f"{name}_vectorized_speedup_over_plain_gpu": steady["plain-gpu"] / steady["fedcore-cuda-vectorized"],
        f"{name}_sequential_cuda_over_plain_gpu": steady["fedcore-cuda"] / steady["plain-gpu"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="W1,W2")
    p.add_argument("--reps", type=int, default=2)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu: torch sees no CUDA GPU on this machine; nothing measured", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    common.CLOCK = "wall"
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    fields: dict[str, float] = {}
    for name in a.workloads.split(","):
        fields.update(measure(name, a.reps))
    print(" ".join(f"{k}={v:.4f}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
