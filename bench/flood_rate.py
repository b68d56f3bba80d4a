"""Flood: the rate a deployed course keeps under a flood of token-less calls.

    python -m bench.flood_rate [--kind rapid-reset|header-flood|both] [--windows 8] [--window 3] [--tls]
                               [--streams 4] [--no-pause]

A server and 3 clients, each its own process on loopback, run a small FedAvg course of
endless rounds (`distribute.max_streams_per_connection: 4`, or `--streams`; 0 leaves the
server's default, the whole call limit, which clients sharing one process need;
`--no-pause` sets `distribute.pause_after_closed_calls: false`, for comparison). `tests.h2_attack` floods the
server from its own process at the lowest CPU priority: 8 connections opening token-less
calls as fast as their sockets allow, each reset at once (rapid reset) or left open (header
flood), every connection the server closes opened again; with `--tls` the course and the
flood speak TLS (certificates made for the run). The flood is paused and resumed
(SIGSTOP, SIGCONT) in alternating windows, so the rest of the machine's load falls on both
alike; the rate with the flood over the rate without it is the figure.

A control pass runs, in the flood's place, a plain CPU loop at the same priority: the ratio
it leaves is what the attacker's own CPU costs the course where the attacker shares the
server's cores (on a 2-core virtual machine even an idle-priority loop takes a quarter of
the rate); an attacker on another machine costs the server only its calls.

Per kind it prints rounds/s without and with the flood and their ratio, the control's ratio,
and the CPU cores the server and the disturbing process took in each kind of window.
Last line: `flood_<kind>_ratio=... control_ratio=...` for each kind.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.proc import cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
COURSE = {
    "seed": 0, "verbose": False, "eval": {"clients": False},
    "federate": {"client_num": 3, "total_round_num": 1_000_000},
    "data": {"type": "synthetic", "partition": "natural",
             "synthetic": {"samples_per_client": 30, "dim": 8, "num_classes": 3}},
    "train": {"batch_size": 10, "optimizer": {"lr": 0.1}},
    "distribute": {"insecure": True, "token": "t", "heartbeat_interval": 0.2, "heartbeat_timeout": 2.0,
                   "retry_timeout": 20.0, "max_streams_per_connection": 4},
}
HOG = "import os\nos.nice(19)\nwhile True:\n    pass\n"


def _cpu(pid: int) -> float:
    """CPU seconds of `pid`, which must still run (a disturber stopped is still there)."""
    seconds = cpu_seconds(pid)
    if seconds is None:
        raise SystemExit(f"flood_rate: process {pid} ended during the measurement")
    return seconds


def _wait(what, seconds: float, label: str):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    raise SystemExit(f"flood_rate: gave up waiting for {label}")


class Course:
    """The server and its 3 clients, each `python -m fedcore.run`, writing under `folder`;
    over TLS where `tls` (the server's certificate checked by the clients, tokens admitting them)."""

    def __init__(self, folder: Path, tls: bool = False, distribute: dict | None = None):
        self.folder, self.procs = folder, []
        cfg = folder / "course.yaml"
        course = {**COURSE, "distribute": {**COURSE["distribute"], **(distribute or {})}}
        course["distribute"] = {k: v for k, v in course["distribute"].items() if v is not None}
        cfg.write_text(yaml.safe_dump(course))
        out = folder / "out"
        self.metrics = out / "metrics.jsonl"
        server_tls, client_tls = [], []
        if tls:
            from fedcore.certs import make_certificates
            files = make_certificates(folder / "certs", clients=0, days=1)
            server_tls = ["distribute.insecure=false", f"distribute.tls.cert={files['server_cert']}",
                          f"distribute.tls.key={files['server_key']}"]
            client_tls = ["distribute.insecure=false", f"distribute.tls.ca={files['ca']}"]
        base = [sys.executable, "-m", "fedcore.run", "--cfg", str(cfg), "federate.mode=distributed"]
        self.server = self._start("server", base + ["distribute.role=server", "distribute.server_port=0",
                                                    f"outdir={out}", *server_tls])
        try:
            address = _wait(lambda: (out / "server_address").exists()
                            and (out / "server_address").read_text().strip(), 120, "the server to listen")
            self.port = int(address.rsplit(":", 1)[1])
            for k in (1, 2, 3):
                self._start(f"client{k}", base + ["distribute.role=client", f"distribute.server_port={self.port}",
                                                  f"distribute.client_id={k}", *client_tls])
            _wait(lambda: self.rounds() >= 20, 120, "the course's first rounds")
        except BaseException:   # a course that never started leaves no process behind
            self.close()
            raise

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(self.folder / f"{name}.log", "ab") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        self.procs.append(p)
        return p

    def rounds(self) -> int:
        return self.metrics.read_text().count("\n") if self.metrics.exists() else 0

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def windows(course: Course, disturber: subprocess.Popen, n: int, seconds: float) -> dict:
    """Alternate `n` windows without and with `disturber` running; rounds/s and CPU cores of
    the server and the disturber in each kind of window."""
    sums = {on: {"rounds": 0, "seconds": 0.0, "server": 0.0, "disturber": 0.0} for on in (False, True)}
    for window in range(n):
        on = window % 2 == 1
        os.kill(disturber.pid, signal.SIGCONT if on else signal.SIGSTOP)
        time.sleep(0.5)   # the disturbance stopped, or under way again
        r0, t0, s0, d0 = course.rounds(), time.monotonic(), _cpu(course.server.pid), _cpu(disturber.pid)
        time.sleep(seconds)
        s = sums[on]
        s["rounds"] += course.rounds() - r0
        s["seconds"] += time.monotonic() - t0
        s["server"] += _cpu(course.server.pid) - s0
        s["disturber"] += _cpu(disturber.pid) - d0
    out = {}
    for on, s in sums.items():
        key = "on" if on else "off"
        out[f"rate_{key}"] = s["rounds"] / s["seconds"]
        out[f"server_cores_{key}"] = s["server"] / s["seconds"]
        out[f"disturber_cores_{key}"] = s["disturber"] / s["seconds"]
    out["ratio"] = out["rate_on"] / out["rate_off"]
    return out


def measure(kind: str, n: int, seconds: float, tls: bool = False, distribute: dict | None = None) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory(prefix="fedcore-flood-") as tmp:
        course = Course(Path(tmp), tls, distribute)
        try:
            report = Path(tmp) / "attack.json"
            attacker = subprocess.Popen([sys.executable, "-m", "tests.h2_attack", str(course.port), kind, "8",
                                         str(n * (seconds + 0.5) + 30), str(report), *(["tls"] if tls else [])],
                                        cwd=ROOT)
            flood = windows(course, attacker, n, seconds)
            attacker.terminate()
            attacker.wait(60)
            flood.update({k: v for k, v in json.loads(report.read_text()).items() if k != "spans"})
            hog = subprocess.Popen([sys.executable, "-c", HOG])
            try:
                control = windows(course, hog, n, seconds)
            finally:
                hog.kill()
                hog.wait()
            if course.server.poll() is not None:
                raise SystemExit(f"flood_rate: the server exited ({course.server.returncode}); see {tmp}")
        finally:
            course.close()
    return flood, control


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["rapid-reset", "header-flood", "both"], default="both")
    ap.add_argument("--windows", type=int, default=8, help="alternating windows, half of them disturbed")
    ap.add_argument("--window", type=float, default=3.0, help="seconds a window is measured")
    ap.add_argument("--tls", action="store_true", help="the course and the flood over TLS (needs the 'certs' extra)")
    ap.add_argument("--streams", type=int, default=4,
                    help="distribute.max_streams_per_connection (0: the server's default)")
    ap.add_argument("--no-pause", action="store_true",
                    help="distribute.pause_after_closed_calls: false (the server takes calls as fast as they come)")
    args = ap.parse_args(argv)
    distribute = {"max_streams_per_connection": args.streams or None,
                  "pause_after_closed_calls": False if args.no_pause else None}
    kinds = ["rapid-reset", "header-flood"] if args.kind == "both" else [args.kind]
    last = []
    for kind in kinds:
        flood, control = measure(kind, args.windows, args.window, args.tls, distribute)
        print(f"{kind}: {flood['rate_off']:.1f} rounds/s without the flood, {flood['rate_on']:.1f} with it "
              f"(ratio {flood['ratio']:.2f}; {flood['calls']:,} calls, {flood['closed']:,} connections closed "
              f"by the server); server {flood['server_cores_off']:.2f} -> {flood['server_cores_on']:.2f} cores, "
              f"attacker {flood['disturber_cores_on']:.2f} cores")
        print(f"{kind} control: a CPU loop at the attacker's priority ({control['disturber_cores_on']:.2f} cores) "
              f"left {control['ratio']:.2f} of the rate ({control['rate_off']:.1f} -> {control['rate_on']:.1f})")
        last.append(f"flood_{kind.replace('-', '_')}{'_tls' if args.tls else ''}_ratio={flood['ratio']:.2f} "
                    f"control_ratio={control['ratio']:.2f}")
    print(" ".join(last))


if __name__ == "__main__":
    main()
