"""W8: large models with bounded server memory.

    python bench/w8_large_model.py [--runs 100MB:8,1GB:8,3GB:2] [--modes deploy,sim] [--rounds 2] [--sum float64|model]
                                   [--algorithms fedavg,fedadam,scaffold,feddyn,fednova,dp] [--spill auto|on|off]
                                   [--executor sequential|processes|vectorized] [--batch-clients N]

For each model size and number of clients, one FedAvg course of an MLP 64 -> H -> 3
(H chosen so its float32 weights take the size; one local step of 10 samples, so
the time goes to moving and aggregating the model) runs with streaming aggregation on:

- `deploy`: a server and one process per client on loopback (gRPC, plaintext), each
  client holding its own copy of the model; the server's peak RSS is measured in its
  own process (bench/peak_rss.py, `getrusage`);
- `sim`: one simulation process: a simulation folds each update as its client sends it
  (algorithms/streaming.py, `fold_when_sent`) and keeps the global model and the running sum
  in files while clients train (`aggregator.spill`), so its peak RSS holds the trainer's
  working model and its gradients or the update being folded, whatever the clients per round.

`--algorithms` runs each size with each algorithm: fedavg, fedadam (FedAvg's mean and a
server Adam step, whose two moments are server state), feddyn (the uniform mean folded; its
drift h is server state, each client's g_i waits in the disk state store), fednova (the
(p/a)-weighted mean folded), scaffold (which folds the weighted
mean of dy_i and the sum of dc_i; each client's control variate waits in the disk state
store, `state.store: disk`, so it is not counted between its rounds; the server's c, the
trainer's c_i and c - c_i and the update's two halves are, where they are resident: a
spilling simulation keeps them in files a slice at a time, algorithms/scaffold.py) or dp
(central DP, `privacy.dp.mode: central`, sigma = C = 1, the server clipping each update:
`clip_each_step: false`; each update's clipped delta is folded into the float64 sum as it
is sent and the noise added once at the round's end, algorithms/dp_fold.py).

`--executor` trains a simulation's clients with that executor (`--batch-clients`:
`executor.batch_clients`): the processes executor's workers send each result as it is trained
and a spilling round's results wait for their deliveries in files (as the vectorized
executor's batch does); the simulation process's peak is measured as before, and the
workers' largest peak (the summary's `worker_peak_rss_mb`) is reported beside it.

`--sum model` keeps the running sum in the model's dtype (`aggregator.streaming_sum`):
a float32 model less on the server, for a mean that depends on the arrival order.

Each run prints its peak RSS over the model's size (and the part above a process's own
footprint, measured first with a 1 MB model) and the wall time of its last round
(the wall time between the last two round records). The last two lines are
`sim_peak_rss_over_model=<the largest simulation's ratio above the baseline>` and
`server_peak_rss_over_model=<the largest deployed server's ratio>`. Sizes that do not
fit the machine's memory are left out with a line saying so (`fits`: a deployed server
peaks at about 2x the model above a 1 MB model's process (the float64 running sum; the
global model and the update being folded wait in files, docs/compression.md), a client at
about 4.3x, a folding simulation at about 2.3x whatever the clients (the global model, the
sum and a server optimizer's moments wait in files, `aggregator.spill`), plus ~0.4 GB per
process). A simulation's ratio is taken above a 1 MB model's simulation (its data, its
workers), a server's above a 1 MB model's server.
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"MB": 10 ** 6, "GB": 10 ** 9}
BASE_PROCESS = 0.4e9            # a python process with torch and grpc, before any model


def parse_runs(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        size, clients = item.split(":")
        number, unit = size[:-2], size[-2:].upper()
        out.append((size, int(float(number) * UNITS[unit]), int(clients)))
    return out


ALGORITHMS = ("fedavg", "fedadam", "scaffold", "feddyn", "fednova", "dp")


def course_yaml(path: Path, size: int, clients: int, rounds: int, running_sum: str = "float64",
                algorithm: str = "fedavg", spill: str = "auto", executor: str = "sequential",
                batch_clients: int | None = None) -> Path:
    hidden = max(1, size // 4 // 69)     # 64*H + H + 3*H + 3 floats
    name = "fedavg" if algorithm in ("fedadam", "dp") else algorithm
    tree = {"seed": 0, "verbose": False, "algorithm": {"name": name},
            "federate": {"client_num": clients, "total_round_num": rounds},
            "data": {"type": "synthetic", "partition": "natural",
                     "synthetic": {"samples_per_client": 10, "dim": 64, "num_classes": 3}},
            "model": {"type": "mlp", "hidden": [hidden]},
            "train": {"batch_size": 10, "local_steps": 1, "optimizer": {"lr": 0.01}},
            "eval": {"clients": False}, "aggregator": {"streaming": "on", "streaming_sum": running_sum,
                           "spill": spill},
            "admission": {"norm_ratio": float("inf")},
            "distribute": {"insecure": True, "token": "w8", "heartbeat_timeout": 600.0},
            "executor": executor}
    if batch_clients is not None:
        tree["executor.batch_clients"] = batch_clients
    if algorithm == "fedadam":
        tree["server_optimizer"] = {"type": "adam"}
    if algorithm == "dp":   # every client every round (q = 1), the server clips and noises
        tree["privacy"] = {"dp": {"mode": "central", "noise_multiplier": 1.0, "clip_norm": 1.0,
                                  "clip_each_step": False}}
    if algorithm in ("scaffold", "feddyn"):   # each client's state (c_i, FedDyn's g_i) waits on disk
        tree["state"] = {"store": "disk", "path": str(path.with_suffix(".states"))}
    path.write_text(yaml.safe_dump(tree))
    return path


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _round_wall(outdir: Path) -> float:
    records = [json.loads(x) for x in (outdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    walls = [r["wall_time"] for r in records]
    return walls[-1] - walls[-2] if len(walls) > 1 else walls[-1]


def run_sim(cfg: Path, out: Path) -> tuple[int, float]:
    peak = out.with_suffix(".rss")
    subprocess.run([sys.executable, "-m", "bench.peak_rss", str(peak), "fedcore.run", "--cfg", str(cfg),
                    f"outdir={out}"], check=True, cwd=ROOT, env=_env())
    return int(peak.read_text()), _round_wall(out)


def worker_peak(out: Path) -> float:
    """The largest peak RSS (bytes) a simulation's worker processes reported (0: none)."""
    summary = json.loads((out / "summary.json").read_text())
    return summary.get("worker_peak_rss_mb", 0.0) * 2 ** 20


def run_deploy(cfg: Path, out: Path, clients: int) -> tuple[int, float]:
    peak, logs = out.with_suffix(".rss"), out.parent / f"{out.name}_logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []

    def start(name, args):
        with (logs / f"{name}.log").open("wb") as fh:
            procs.append(subprocess.Popen([sys.executable, *args], stdout=fh, stderr=subprocess.STDOUT,
                                          cwd=ROOT, env=_env()))
        return procs[-1]
    try:
        server = start("server", ["-m", "bench.peak_rss", str(peak), "fedcore.run", "--cfg", str(cfg),
                                  "federate.mode=distributed", "distribute.role=server",
                                  "distribute.server_port=0", f"outdir={out}"])
        address = out / "server_address"
        deadline = time.monotonic() + 300
        while not (address.exists() and address.read_text().strip()):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {(logs / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)
        port = address.read_text().strip().rsplit(":", 1)[1]
        for k in range(1, clients + 1):
            start(f"client{k}", ["-m", "fedcore.run", "--cfg", str(cfg), "federate.mode=distributed",
                                 "distribute.role=client", f"distribute.server_port={port}",
                                 f"distribute.client_id={k}"])
        if server.wait(3600) != 0:
            raise RuntimeError(f"server failed: {(logs / 'server.log').read_text()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return int(peak.read_text()), _round_wall(out)


def fits(mode: str, size: int, clients: int, available: int, algorithm: str = "fedavg") -> bool:
    """Whether a run should fit in `available` bytes, from what was measured: a deployed
    server peaks at ~2x the model, a client at ~4.3x, but not at once (a 2.25 GB model, one
    client: the machine's available memory fell by 6x the model at most); a simulation
    process that folds at ~2.3x (the trainer's working copy, and its gradients or the update
    being folded; the global model, the running sum and a server optimizer's moments wait in
    files, `aggregator.spill`, whose pages the system's cache holds: ~4x more), SCAFFOLD's
    alike (c, c_i, c - c_i and the update's halves wait in files too: ~4 models more in the
    cache, and each client's c_i+ in the state store's log)."""
    if mode == "deploy":
        need = (3.5 + 2 * clients) * size + (clients + 1) * BASE_PROCESS
    else:
        need = (12 if algorithm in ("scaffold", "feddyn") else 8) * size + BASE_PROCESS
    return need < 0.9 * available


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="100MB:8,1GB:8,3GB:2")
    p.add_argument("--modes", default="deploy,sim")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sum", default="float64", choices=("float64", "model"),
                   help="aggregator.streaming_sum: the running sum in float64 (exact in any order) "
                        "or in the model's dtype (a model less)")
    p.add_argument("--spill", default="auto", choices=("auto", "on", "off"),
                   help="aggregator.spill: a simulation keeps the global model and the running sum "
                        "in files while clients train (auto: models of 64 MiB or more)")
    p.add_argument("--executor", default="sequential", choices=("sequential", "processes", "vectorized"),
                   help="executor of the simulations (deployed clients train on their own)")
    p.add_argument("--batch-clients", type=int, default=None,
                   help="executor.batch_clients: the most clients trained together (vectorized, processes)")
    p.add_argument("--algorithms", default="fedavg",
                   help=f"comma-separated, of {', '.join(ALGORITHMS)}")
    args = p.parse_args(argv)
    algorithms = args.algorithms.split(",")
    if not set(algorithms) <= set(ALGORITHMS):
        p.error(f"--algorithms: one of {', '.join(ALGORITHMS)} each")
    modes = args.modes.split(",")
    largest, largest_sim = 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        # a process's own footprint (python, torch, grpc, the data), from a 1 MB model's
        # deployed server, and from a 1 MB model's simulation for the simulations
        base, _ = run_deploy(course_yaml(Path(tmp) / "base.yaml", 10 ** 6, 2, 1), Path(tmp) / "base", 2)
        print(f"W8 process baseline (server of a 1 MB model): {base / 1e9:.2f} GB", flush=True)
        base_sim = base
        if "sim" in modes:
            base_sim, _ = run_sim(course_yaml(Path(tmp) / "base_sim.yaml", 10 ** 6, 8, 1, executor=args.executor,
                                              batch_clients=args.batch_clients), Path(tmp) / "base_sim")
            print(f"W8 process baseline (simulation of a 1 MB model): {base_sim / 1e9:.2f} GB", flush=True)
        for label, size, clients in parse_runs(args.runs):
            for mode in modes:
                for algorithm in algorithms:
                    if not fits(mode, size, clients, available_bytes(), algorithm):
                        print(f"W8 {mode} {label} x{clients} {algorithm}: left out, does not fit the "
                              f"{available_bytes() / 1e9:.1f} GB available", flush=True)
                        continue
                    name = f"{mode}_{label}_{clients}_{algorithm}"
                    out = Path(tmp) / name
                    sim = mode != "deploy"
                    cfg = course_yaml(Path(tmp) / f"{name}.yaml", size, clients, args.rounds, args.sum, algorithm,
                                      args.spill, args.executor if sim else "sequential",
                                      args.batch_clients if sim else None)
                    peak, wall = (run_deploy(cfg, out, clients) if mode == "deploy" else run_sim(cfg, out))
                    ratio = peak / size
                    who = "server" if mode == "deploy" else "simulation process"
                    own = base if mode == "deploy" else base_sim
                    print(f"W8 {mode} {label} x{clients} {algorithm}: {who} peak RSS {peak / 1e9:.2f} GB = "
                          f"{ratio:.2f}x the model ({(peak - own) / size:.2f}x above the baseline"
                          + ("" if mode == "deploy" else f", {(peak - base) / size:.2f}x above the server's")
                          + f"); {wall:.1f} s wall per round", flush=True)
                    workers = worker_peak(out) if sim else 0.0
                    if workers:
                        print(f"W8 {mode} {label} x{clients} {algorithm} executor {args.executor}: the "
                              f"workers' largest peak RSS {workers / 1e9:.2f} GB = {workers / size:.2f}x "
                              "the model", flush=True)
                    if mode == "deploy":
                        largest = max(largest, ratio)
                    else:
                        largest_sim = max(largest_sim, (peak - own) / size)
    print(f"sim_peak_rss_over_model={largest_sim:.2f}")
    print(f"server_peak_rss_over_model={largest:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
