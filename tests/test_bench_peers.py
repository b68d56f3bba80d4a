"""`python -m bench.peers` smoke-runs: it checks equal work, prints one table and one
key=value line; `--device cuda` without a GPU is one line and exit 2."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def _peers(*args: str) -> subprocess.CompletedProcess:
    # a fresh interpreter: the benchmark forks one process per system from a parent that has
    # computed nothing with torch
    return subprocess.run([sys.executable, "-m", "bench.peers", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_p2_smoke_run_checks_equal_work_and_reports_one_line():
    out = _peers("--workload", "p2", "--rounds", "2", "--users", "20", "--workers", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    checks = [line for line in lines if line.startswith("equal work")]
    assert len(checks) == 4 and all(float(line.rsplit(" ", 1)[1]) <= 1e-5 for line in checks)
    for system in ("plain", "sequential", "sequential-all-cores", "vectorized", "processes"):
        assert any(line.split()[0] == system for line in lines if line.strip())
    last = dict(item.split("=", 1) for item in lines[-1].split())
    assert {"vectorized_over_plain", "sequential_over_plain", "best_over_plain",
            "peak_rss_over_plain", "batched_fits", "sequential_fits"} <= set(last)
    # 2 rounds x 10 sampled clients, all of them trained by the vectorized engine
    assert last["batched_fits"] == "20" and last["sequential_fits"] == "0"
    assert float(last["vectorized_vs_sequential_diff"]) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_and_exit_2(capsys, monkeypatch):
    # the entry point in this process: it refuses before it forks or computes anything
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)   # main sets it: put back after
    from bench.peers import main
    code = main(["--workload", "p1", "--device", "cuda"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert len(out.err.strip().splitlines()) == 1 and "CUDA" in out.err
