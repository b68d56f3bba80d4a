"""A launch of 30 clients on a small machine: the default start method against spawn.

    python -m bench.launch_laptop [--clients 30] [--rounds 3] [--timeout 1200] [KEY=VALUE ...]

Runs `python -m fedcore.launch --cfg scenarios/quickstart.yaml --clients N` (a 3-round
course of N clients, 10 a round) twice in one run: with the default start method (the
fork server where available) and with `--start-method spawn`. For each it prints the
seconds from the launch to the first round's record in `metrics.jsonl` and to the
launcher's exit, its exit status, and the load average before and after (the machine may
be shared); then the ratios spawn / default, where both launches ended with status 0.
A launch still running after `--timeout` seconds is stopped (SIGTERM, the launcher's orderly
stop) and reported as such. KEY=VALUE overrides go to both launches.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def launch(method: str | None, clients: int, rounds: int, timeout: float, overrides: list[str]) -> dict:
    """One launch; its seconds to the first round and to the end, and its exit status."""
    out = Path(tempfile.mkdtemp(prefix=f"fedcore-bench-launch-{method or 'default'}-"))
    argv = [sys.executable, "-m", "fedcore.launch", *(["--start-method", method] if method else []),
            "--startup-timeout", str(timeout), "--cfg", str(ROOT / "scenarios" / "quickstart.yaml"),
            "--clients", str(clients), f"federate.total_round_num={rounds}", "eval.freq=1",
            f"outdir={out / 'run'}", "verbose=false", *overrides]
    metrics = out / "run" / "metrics.jsonl"
    load_before = _load()
    t0 = time.monotonic()
    log = open(out / "launch.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    first = None
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        if first is None and metrics.exists() and metrics.read_text().count("\n") >= 1:
            first = time.monotonic() - t0
        time.sleep(0.2)
    rc = proc.poll()
    if rc is None:
        proc.send_signal(signal.SIGTERM)
        rc = f"stopped after {timeout:g}s"
        proc.wait(60)
    end = time.monotonic() - t0
    if first is None and metrics.exists() and metrics.read_text().count("\n") >= 1:
        first = end
    log.close()
    return {"method": method or "default", "first_round_s": first, "end_s": end, "rc": rc,
            "load_before": load_before, "load_after": _load(), "log": out / "launch.log"}


def _fmt(v: float | None) -> str:
    return "none" if v is None else f"{v:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before a launch is stopped")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for both launches")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    results = []
    for method in (None, "spawn"):
        r = launch(method, args.clients, args.rounds, args.timeout, args.overrides)
        results.append(r)
        print(f"{r['method']}: first_round_s={_fmt(r['first_round_s'])} end_s={_fmt(r['end_s'])} rc={r['rc']} "
              f"load_before={r['load_before']} load_after={r['load_after']} log={r['log']}", flush=True)
    default, spawn = results
    ratios = []
    for key in ("first_round_s", "end_s"):
        if default["rc"] == 0 and spawn["rc"] == 0:
            ratios.append(f"{key.removesuffix('_s')}_spawn_over_default={spawn[key] / default[key]:.2f}")
    print(" ".join(ratios) or "no ratio: a launch did not end with status 0", flush=True)


if __name__ == "__main__":
    main()
