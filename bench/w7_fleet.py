"""W7 fleet: one server process, N connected clients, a tiny model, all sampled every round.

    python -m bench.w7_fleet [--clients 1000,5000,10000] [--rounds 3] [--procs 4]

For each N the server (`python -m fedcore.run ... distribute.role=server`, this
project's deployed server) serves a FedAvg course of logistic regression
784 -> 10 (31.4 KB of float32) to N clients run by `bench.fleet` load
generators (`--procs` processes, asyncio, no torch). Every client is sampled
every round and answers with an update at once, so a round is the server's
work: broadcast N models, receive, check and aggregate N updates.

Measured from outside the server: round seconds (between the moments the first
client sees successive rounds' models, and the last round until `finish`;
median over rounds), the server's peak RSS (sampled from /proc every 0.2 s)
its CPU seconds (user + system) per round over the rounds, and its largest
thread count. The load
generators run on the same machine and share its cores with the server.
Last line: `w7_clients=N w7_round_s=... w7_server_rss_mb=... w7_server_cpu_s_per_round=...`
for the largest N that completed.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from fedcore.comm.chunking import first_chunk_size

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "w7-fleet-token"
# A fleet's heartbeats: N clients send N / interval frames a second each way, so a fleet
# server wants a longer interval than the default 2 s (docs/deployment.md).
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 30.0, 120.0
# The first chunk the course's own clients would send (its defaults: 2 MiB chunks, 10 KB/s).
FIRST = first_chunk_size(2 * 1024 * 1024, HEARTBEAT_TIMEOUT, 10_000.0)


def _proc_stat(pid: int) -> tuple[float, float, int] | None:
    """(CPU seconds user+system, RSS MB, threads) of `pid`, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss_pages = int(fields[21])
    except (OSError, IndexError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return ((int(fields[11]) + int(fields[12])) / tick, rss_pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20,
            int(fields[17]))


class Sampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples = pid, []   # (monotonic, cpu_s, rss_mb, threads)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            s = _proc_stat(self.pid)
            if s is None:
                return
            self.samples.append((time.monotonic(), *s))
            self.stop.wait(0.2)

    def cpu_at(self, t: float) -> float:
        """CPU seconds at time `t` (the last sample not after it)."""
        before = [c for ts, c, _, _ in self.samples if ts <= t]
        return before[-1] if before else self.samples[0][1]


def course_cfg(n: int, rounds: int, path: Path) -> Path:
    tree = {
        "seed": 0, "verbose": False,
        "federate": {"client_num": n, "total_round_num": rounds, "mode": "distributed"},
        "data": {"type": "synthetic", "partition": "natural",
                 "synthetic": {"samples_per_client": 2, "dim": 784, "num_classes": 10}},
        "model": {"type": "logreg"}, "train": {"batch_size": 2, "local_steps": 1},
        "eval": {"clients": False},
        # a fleet of devices it does not control: the server checks each update's influence
        "admission": {"norm_ratio": 10.0},
        "distribute": {"insecure": True, "token": TOKEN, "heartbeat_interval": HEARTBEAT_INTERVAL,
                       "heartbeat_timeout": HEARTBEAT_TIMEOUT},
    }
    path.write_text(yaml.safe_dump(tree))
    return path


def run_one(n: int, rounds: int, procs: int, workdir: Path, timeout: float, channels: int) -> dict | None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cfg = course_cfg(n, rounds, workdir / f"w7_{n}.yaml")
    out = workdir / f"out_{n}"
    server_log = (workdir / f"server_{n}.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "fedcore.run", "--cfg", str(cfg),
                               "distribute.role=server", "distribute.server_port=0", f"outdir={out}",
                               "outdir_overwrite=true"],   # a rerun with the same --logs replaces its runs
                              stdout=server_log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    sampler = Sampler(server.pid)
    sampler.start()
    address = out / "server_address"
    deadline = time.monotonic() + timeout
    while not address.exists():
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            print(f"N={n}: the server did not start; see {server_log.name}", file=sys.stderr)
            return None
        time.sleep(0.1)
    port = int(address.read_text().split(":")[-1])
    share = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    gens, first = [], 1
    for i, count in enumerate(share):
        gens.append(subprocess.Popen(
            [sys.executable, "-m", "bench.fleet", "--port", str(port), "--first", str(first),
             "--count", str(count), "--token", TOKEN, "--first-chunk", str(FIRST),
             "--heartbeat", str(HEARTBEAT_INTERVAL),
             "--channels", str(channels)],
            stdout=subprocess.PIPE, stderr=(workdir / f"fleet_{n}_{i}.log").open("wb"),
            env=env, cwd=ROOT, text=True))
        first += count
    lines: list[str] = []
    readers = [threading.Thread(target=lambda g=g: lines.extend(g.stdout), daemon=True) for g in gens]
    for r in readers:
        r.start()
    ok = True
    try:
        server.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        ok = False
        server.kill()
    for g in gens:
        try:
            g.wait(30)
        except subprocess.TimeoutExpired:
            g.kill()
    sampler.stop.set()
    with (workdir / f"server_{n}_samples.tsv").open("w") as f:   # for a look at RSS over time
        f.write("monotonic_s\tcpu_s\trss_mb\tthreads\n")
        f.writelines("\t".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + "\n"
                     for row in sampler.samples)
    if not ok or server.returncode != 0:
        print(f"N={n}: the course did not finish (rc={server.returncode}); see {server_log.name}",
              file=sys.stderr)
        return None
    starts: dict[int, float] = {}
    finish, reconnects = None, 0
    (workdir / f"fleet_{n}.out").write_text("".join(lines))
    for line in lines:
        if line.startswith("fleet done"):
            reconnects += int(line.split("reconnects=")[1])
        if line.startswith("round "):
            r, t = line.split()[1], float(line.split("t=")[1])
            starts[int(r)] = min(t, starts.get(int(r), t))
        elif line.startswith("finish "):
            t = float(line.split("t=")[1])
            finish = t if finish is None else min(finish, t)
    marks = [starts[r] for r in sorted(starts)] + ([finish] if finish is not None else [])
    durations = [b - a for a, b in zip(marks, marks[1:])]
    if len(durations) < rounds:
        print(f"N={n}: saw {len(starts)} rounds and finish={finish}", file=sys.stderr)
        return None
    cpu = sampler.cpu_at(marks[-1]) - sampler.cpu_at(marks[0])
    return {"clients": n, "round_s": statistics.median(durations), "rounds_s": durations,
            "rss_mb": max(s[2] for s in sampler.samples), "cpu_s_per_round": cpu / len(durations),
            "threads": max(s[3] for s in sampler.samples), "reconnects": reconnects}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1000,5000,10000", help="comma-separated fleet sizes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--procs", type=int, default=4, help="load-generator processes")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per fleet size")
    p.add_argument("--channels", type=int, default=8,
                   help="connections per load-generator process (0: one per client, as in a real fleet)")
    p.add_argument("--logs", help="keep the server's and load generators' logs in this folder")
    args = p.parse_args(argv)
    results = []
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(args.logs) if args.logs else tempfile.TemporaryDirectory(prefix="w7_")) as tmp:
        for n in (int(x) for x in args.clients.split(",")):
            res = run_one(n, args.rounds, args.procs, Path(tmp), args.timeout, args.channels)
            if res is None:
                continue
            results.append(res)
            print(f"N={n}: round {res['round_s']:.2f}s (rounds {', '.join(f'{d:.2f}' for d in res['rounds_s'])}), "
                  f"server peak RSS {res['rss_mb']:.0f} MB, server CPU {res['cpu_s_per_round']:.2f} s/round, "
                  f"server threads at most {res['threads']}, client reconnects {res['reconnects']}",
                  flush=True)
    if not results:
        print("w7_clients=0 w7_round_s=nan w7_server_rss_mb=nan w7_server_cpu_s_per_round=nan")
        return 1
    r = results[-1]
    print(f"w7_clients={r['clients']} w7_round_s={r['round_s']:.3f} w7_server_rss_mb={r['rss_mb']:.0f} "
          f"w7_server_cpu_s_per_round={r['cpu_s_per_round']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
