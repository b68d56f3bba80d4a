"""Health checks under a call flood: how fast /healthz and /readyz answer while an outsider floods.

    python -m bench.health_latency [--kind rapid-reset|header-flood] [--windows 6] [--probes 100]

The course, the flood and its pauses are `bench.flood_rate`'s: a server and 3 clients, each
its own process on loopback, run endless FedAvg rounds, here with `distribute.metrics_port`
set; `tests.h2_attack` floods the gRPC port with token-less calls (8 connections, lowest CPU
priority), paused and resumed (SIGSTOP, SIGCONT) in alternating windows so the rest of the
machine's load falls on both alike. In each window a probe asks /healthz and /readyz in
turn, each on a new connection as a supervisor's probe does, `--probes` times, and times the
answer. Prints the p50 and p99 latency (ms) of the idle windows and of the flooded ones and
their ratio; last line: `health_p50_ms=... health_p99_ms=... idle_p99_ms=... p99_ratio=...`
(the flooded figures unprefixed). Not a timed test: a figure for docs/operations.md.
"""
from __future__ import annotations

import argparse
import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.flood_rate import ROOT, Course, _wait

PATHS = ("/healthz", "/readyz")


def probe(port: int, path: str) -> float:
    """Seconds from connecting to the whole answer of one request; fails on anything but 200."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise SystemExit(f"health_latency: {path} answered {r.status}")
    finally:
        conn.close()
    return time.perf_counter() - t0


def quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def measure(kind: str, windows: int, probes: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"idle": [], "flood": []}
    with tempfile.TemporaryDirectory(prefix="fedcore-health-") as tmp:
        course = Course(Path(tmp), distribute={"metrics_port": 0})
        try:
            address = _wait(lambda: (Path(tmp) / "out" / "metrics_address").exists()
                            and (Path(tmp) / "out" / "metrics_address").read_text().strip(), 60,
                            "the metrics endpoint")
            port = int(address.rsplit(":", 1)[1])
            duration = windows * (probes * 0.05 + 5) + 60
            attacker = subprocess.Popen([sys.executable, "-m", "tests.h2_attack", str(course.port), kind, "8",
                                         str(duration), str(Path(tmp) / "attack.json")], cwd=ROOT)
            try:
                time.sleep(2.0)   # the flood under way
                for window in range(windows):
                    on = window % 2 == 1
                    os.kill(attacker.pid, signal.SIGCONT if on else signal.SIGSTOP)
                    time.sleep(0.5)
                    for i in range(probes):
                        out["flood" if on else "idle"].append(probe(port, PATHS[i % 2]))
                        time.sleep(0.01)
            finally:
                os.kill(attacker.pid, signal.SIGCONT)
                attacker.terminate()
                attacker.wait(60)
            if course.server.poll() is not None:
                raise SystemExit(f"health_latency: the server exited ({course.server.returncode})")
        finally:
            course.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["rapid-reset", "header-flood"], default="rapid-reset")
    ap.add_argument("--windows", type=int, default=6, help="alternating windows, half of them flooded")
    ap.add_argument("--probes", type=int, default=100, help="requests per window")
    args = ap.parse_args(argv)
    got = measure(args.kind, args.windows, args.probes)
    ms = {k: (1000 * quantile(v, 0.5), 1000 * quantile(v, 0.99)) for k, v in got.items()}
    for k in ("idle", "flood"):
        print(f"{k}: {len(got[k])} probes of /healthz and /readyz, p50 {ms[k][0]:.2f} ms, "
              f"p99 {ms[k][1]:.2f} ms, max {1000 * max(got[k]):.2f} ms")
    print(f"health_p50_ms={ms['flood'][0]:.2f} health_p99_ms={ms['flood'][1]:.2f} "
          f"idle_p50_ms={ms['idle'][0]:.2f} idle_p99_ms={ms['idle'][1]:.2f} "
          f"p99_ratio={ms['flood'][1] / ms['idle'][1]:.2f}")


if __name__ == "__main__":
    main()
