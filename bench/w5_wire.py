"""W5 wire: the real gRPC transport on loopback, between separate processes.

    python -m bench.w5_wire [--mb 100] [--clients 4] [--reps 3] [--latency-clients 50]
                            [--latency-rounds 20] [--tls] [--chunk-size BYTES]

Throughput: the server (this process, `fedcore.comm.grpc_server.GrpcServerComm`)
broadcasts one model of `--mb` MB (float32) to `--clients` client processes
(`fedcore.comm.grpc_client.GrpcClientComm`); each client decodes it, encodes it
again and sends it back, as a client returning its trained model does. A
repetition is timed from the broadcast until the last reply is decoded at the
server. MB/s counts the payload moved both ways, 2 x clients x size / seconds
(1 MB = 10^6 bytes).

Round latency: `--latency-clients` clients (in a few processes, ten clients each)
receive a tiny model (logistic regression 784->10, 31 KB) and send it back; a
round is the broadcast until the last reply, median over `--latency-rounds`.

Both use the transport as a deployment does: chunking, SHA-256 integrity
checks, tokens, heartbeats; `insecure` (plaintext) by default, `--tls` with a
throw-away CA and server certificate (needs the `cryptography` package).
Last line: `w5_mb_per_s=... w5_round_latency_s=...`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.proc import cpu_seconds
from fedcore.certs import make_certificates
from fedcore.kernel.config import load_config
from fedcore.kernel.message import Message
from fedcore.kernel.scheduler import ImmediateScheduler

TOKEN = "bench-token"
ROOT = Path(__file__).resolve().parents[1]


class _Endpoint:
    """A stand-in worker: accepts `blob` messages and hands them to `on_message`."""

    def __init__(self, worker_id: int, on_message):
        self.id = worker_id
        self.handlers = type("T", (), {"entries": {"receiving_blob": None}})()
        self.on_message = on_message
        self.finished = False

    def deliver(self, msg: Message) -> None:
        self.on_message(msg)


def _cfg(role: str, n: int, port: int, chunk: int, tls: dict | None, client_id: int = 0):
    extra = {"federate.mode": "distributed", "federate.client_num": n, "distribute.role": role,
             "distribute.server_port": port, "distribute.token": TOKEN,
             "distribute.chunk_size": chunk, "distribute.heartbeat_interval": 2.0,
             "distribute.heartbeat_timeout": 120.0, "distribute.client_id": client_id,
             "verbose": False}
    if tls is None:
        extra["distribute.insecure"] = True
    elif role == "server":
        extra.update({"distribute.tls.cert": tls["server_cert"], "distribute.tls.key": tls["server_key"]})
    else:
        extra["distribute.tls.ca"] = tls["ca"]
    return load_config(None, extra=extra)


# ---------------------------------------------------------------- client processes
def echo_clients(port: int, ids: list[int], n: int, chunk: int, tls: dict | None) -> None:
    """Connect one client per id; send every received model straight back. Runs until killed."""
    from fedcore.comm.grpc_client import GrpcClientComm
    torch.set_num_threads(1)
    comms = []
    for cid in ids:
        comm = GrpcClientComm(_cfg("client", n, port, chunk, tls, cid), ImmediateScheduler())

        def echo(msg: Message, comm=comm, cid=cid) -> None:
            comm.send(Message("blob", cid, (0,), msg.round, msg.timestamp, msg.content))
        comm.start()
        comms.append((comm, echo, cid))
    for comm, echo, cid in comms:
        comm.wait_welcome()
        comm.attach(_Endpoint(cid, echo))
    print("ready", flush=True)
    threading.Event().wait()


# ---------------------------------------------------------------- the server side
class _Server:
    def __init__(self, n: int, chunk: int, tls: dict | None):
        from fedcore.comm.grpc_server import GrpcServerComm
        self.replies: list[Message] = []
        self.cond = threading.Condition()
        self.comm = GrpcServerComm(_cfg("server", n, 0, chunk, tls), ImmediateScheduler(), lambda *a: None,
                                   lambda *a: None)
        self.comm.attach(_Endpoint(0, self._got))
        self.port = self.comm.start()
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def _got(self, msg: Message) -> None:
        with self.cond:
            self.replies.append(msg)
            self.cond.notify_all()

    def spawn(self, per_process: int, chunk: int, tls_dir: str | None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        ids = list(range(1, self.n + 1))
        for k in range(0, self.n, per_process):
            group = ",".join(map(str, ids[k:k + per_process]))
            args = [sys.executable, "-m", "bench.w5_wire", "--serve-clients", group, "--port",
                    str(self.port), "--total", str(self.n), "--chunk-size", str(chunk)]
            if tls_dir:
                args += ["--tls-dir", tls_dir]
            log = tempfile.TemporaryFile()    # a file, not a pipe: a chatty client never blocks
            proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            proc.log = log    # type: ignore[attr-defined]
            self.procs.append(proc)
        deadline = time.monotonic() + 300
        while len(self.comm.live_ids()) < self.n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                out = ""
                for p in self.procs:
                    p.log.seek(0)
                    out += p.log.read().decode(errors="replace")
                raise RuntimeError(f"clients did not connect: {out[-2000:]}")
            time.sleep(0.05)

    def round_trip(self, content: dict, round_: int) -> float:
        """Broadcast `content` to every client; seconds until all replies are in."""
        with self.cond:
            self.replies.clear()
        t0 = time.perf_counter()
        self.comm.send(Message("blob", 0, tuple(range(1, self.n + 1)), round_, 0.0, content))
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.replies) >= self.n, timeout=600)
        dt = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"only {len(self.replies)} of {self.n} replies")
        return dt

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of this process and of all client processes (Linux /proc)."""
        clients = sum(filter(None, (cpu_seconds(p.pid) for p in self.procs)))
        return time.process_time(), clients

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
            p.log.close()
        self.comm.stop(0.5)


def _check_echo(sent: dict, replies: list[Message]) -> None:
    for m in replies:
        for k, t in sent["model"].items():
            if not torch.equal(m.content["model"][k], t):
                raise RuntimeError(f"client {m.sender} returned a different '{k}'")


def throughput(mb: float, clients: int, reps: int, chunk: int, tls: dict | None,
               tls_dir: str | None) -> float:
    numel = int(mb * 1e6 / 4)
    model = {"model": {"w": torch.randn(numel, generator=torch.Generator().manual_seed(0))}}
    srv = _Server(clients, chunk, tls)
    try:
        srv.spawn(1, chunk, tls_dir)
        times = []
        for r in range(reps + 1):   # the first is a warm-up (allocations, first connections' windows)
            c0 = srv.cpu()
            dt = srv.round_trip(model, r + 1)
            c1 = srv.cpu()
            _check_echo(model, srv.replies)
            srv.replies.clear()
            if r:
                times.append(dt)
            print(f"W5 {mb:g} MB x {clients} clients, rep {r}{' (warm-up)' if r == 0 else ''}: "
                  f"{dt:.2f} s, {2 * clients * mb / dt:.0f} MB/s; CPU seconds: server {c1[0] - c0[0]:.2f}, "
                  f"clients {c1[1] - c0[1]:.2f}", flush=True)
    finally:
        srv.close()
    best = min(times)
    return 2 * clients * mb / best


def latency(clients: int, rounds: int, chunk: int, tls: dict | None, tls_dir: str | None) -> float:
    model = torch.nn.Linear(784, 10)
    content = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
               "num_samples": 10}
    srv = _Server(clients, chunk, tls)
    try:
        srv.spawn(10, chunk, tls_dir)
        times = [srv.round_trip(content, r + 1) for r in range(rounds + 2)][2:]
        _check_echo(content, srv.replies)
    finally:
        srv.close()
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--latency-clients", type=int, default=50)
    p.add_argument("--latency-rounds", type=int, default=20)
    p.add_argument("--tls", action="store_true", help="also measure with TLS")
    p.add_argument("--chunk-size", type=int, default=None, help="distribute.chunk_size (bytes)")
    p.add_argument("--serve-clients", default=None, help=argparse.SUPPRESS)   # internal: client process
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tls-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    chunk = a.chunk_size or load_config(None)["distribute.chunk_size"]
    if a.serve_clients:
        tls = _tls_files(a.tls_dir) if a.tls_dir else None
        echo_clients(a.port, [int(c) for c in a.serve_clients.split(",")], a.total, chunk, tls)
        return 0
    torch.set_num_threads(1)
    fields = {}
    modes = [("insecure", None)]
    tmp = None
    if a.tls:
        tmp = tempfile.mkdtemp(prefix="fedcore-w5-")
        make_certificates(tmp, clients=0, days=1)   # a throw-away CA and server certificate
        modes.append(("tls", tmp))
    for name, tls_dir in modes:
        tls = _tls_files(tls_dir) if tls_dir else None
        mbps = throughput(a.mb, a.clients, a.reps, chunk, tls, tls_dir)
        lat = latency(a.latency_clients, a.latency_rounds, chunk, tls, tls_dir)
        print(f"W5 {name}: {a.mb:g} MB model to {a.clients} client processes and back: {mbps:.0f} MB/s "
              f"(target >= 300: {'met' if mbps >= 300 else 'MISSED'}); round latency with "
              f"{a.latency_clients} clients, tiny model: {lat * 1000:.1f} ms (median of "
              f"{a.latency_rounds}); chunk {chunk} bytes", flush=True)
        suffix = "" if name == "insecure" else "_tls"
        fields[f"w5_mb_per_s{suffix}"] = f"{mbps:.1f}"
        fields[f"w5_round_latency_s{suffix}"] = f"{lat:.4f}"
    print(" ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


def _tls_files(folder: str) -> dict:
    f = Path(folder)
    return {"ca": str(f / "ca.pem"), "server_cert": str(f / "server.pem"), "server_key": str(f / "server.key")}


if __name__ == "__main__":
    sys.exit(main())
