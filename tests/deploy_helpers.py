"""Helpers for the multi-process deployment tests: configs, processes, certificates.

Every process is started on 127.0.0.1 through `Procs`, which kills whatever is
still running when the test ends, pass or fail. Servers listen on a free port
(`distribute.server_port=0`) and write it to `<outdir>/server_address`.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "seed": 0, "verbose": False,
    "federate": {"client_num": 3, "total_round_num": 2},
    "data": {"type": "synthetic", "partition": "natural",
             "synthetic": {"samples_per_client": 30, "dim": 8, "num_classes": 3}},
    "train": {"batch_size": 10, "optimizer": {"lr": 0.1}},
}


def write_cfg(path: Path, extra: dict | None = None) -> Path:
    """A small course's YAML (the same numbers as tests.conftest.small_cfg, 3 clients)."""
    tree = yaml.safe_load(yaml.safe_dump(BASE))
    for dotted, value in (extra or {}).items():
        node = tree
        parts = dotted.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    path.write_text(yaml.safe_dump(tree))
    return path


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


_fork_server_of_this_process = None


def _fork_server():
    """This test process's fork server (fedcore/deployment/forkserver.py, the one
    `fedcore.launch` uses), started at first use; None where FEDCORE_TEST_FORKSERVER=0 asks for a
    fresh interpreter per process, or where the system cannot fork one."""
    global _fork_server_of_this_process
    from fedcore.deployment.forkserver import ForkServer, available
    if os.environ.get("FEDCORE_TEST_FORKSERVER", "1") == "0" or not available():
        return None
    if _fork_server_of_this_process is None:
        _fork_server_of_this_process = ForkServer(_env(), str(ROOT))
        atexit.register(_fork_server_of_this_process.close)
    return _fork_server_of_this_process


def run_fedcore(args, env: dict | None = None, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m fedcore.run ARGS` to its end, as `subprocess.run(..., capture_output=True,
    text=True)` runs it (`env` None: this process's; `cwd` None: this one's), forked from
    this test process's fork server where there is one."""
    argv = [sys.executable, "-m", "fedcore.run", *map(str, args)]
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    server = _fork_server()
    if server is None:
        return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null:
        p = server.spawn(argv[3:], env, cwd, (null.fileno(), out.fileno(), err.fileno()))
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


class Procs:
    """Starts processes with their output in files; `cleanup()` kills the survivors.

    `python -m fedcore.run` and `fedcore.launch` processes are forked from a fork server that
    imported torch, gRPC and fedcore once (fedcore/deployment/forkserver.py): real processes,
    without three seconds of imports each."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, name: str, args: list[str], env: dict | None = None, **popen) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        forked = args[0] == "-m" and args[1] in ("fedcore.run", "fedcore.launch") and not popen
        server = _fork_server() if forked else None
        full_env = {**_env(), **(env or {})}
        if server is not None:
            with log.open("ab") as fh, open(os.devnull, "rb") as null:
                p = server.spawn(args[2:], full_env, str(ROOT), (null.fileno(), fh.fileno(), fh.fileno()),
                                 module=args[1])
        else:
            fh = log.open("ab")
            p = subprocess.Popen([sys.executable, *args], stdout=fh, stderr=subprocess.STDOUT,
                                 cwd=ROOT, env=full_env, **popen)
            fh.close()
        p.log = log  # type: ignore[attr-defined]
        self.procs.append((p, log))
        return p

    def fedcore(self, name: str, cfg: Path, *overrides: str, **kw) -> subprocess.Popen:
        return self.start(name, ["-m", "fedcore.run", "--cfg", str(cfg), "federate.mode=distributed",
                                 *overrides], **kw)

    def cleanup(self) -> None:
        for p, _ in self.procs:
            if p.poll() is None:
                p.kill()
        for p, _ in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def text(p: subprocess.Popen) -> str:
    return Path(p.log).read_text(errors="replace")  # type: ignore[attr-defined]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def wait_exit(p: subprocess.Popen, timeout: float) -> int:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"process did not exit within {timeout:g}s; output:\n{text(p)[-3000:]}")


def server_port(outdir: Path, server: subprocess.Popen, timeout: float = 300.0) -> int:
    f = outdir / "server_address"

    def ready():
        if server.poll() is not None:
            raise AssertionError(f"server exited with {server.returncode}:\n{text(server)[-3000:]}")
        return f.exists() and f.read_text().strip()
    return int(wait_for(ready, timeout, "the server to listen").rsplit(":", 1)[1])


def serve_course(procs, cfg: Path, out: Path):
    """A server for `cfg` on a free port writing to `out`, its port, and a function that starts
    client k against it (`procs` is the test's process fixture)."""
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)

    def client(k):
        return procs.fedcore(f"client{k}", cfg, "distribute.role=client",
                             f"distribute.server_port={port}", f"distribute.client_id={k}")
    return server, port, client


def interrupt(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGINT)


FORK = ["--start-method", "forkserver"]   # launches whose processes the test does not look at


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (Linux: reads /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def launched(launcher: int) -> list[int]:
    """The course processes (server, edges, clients) a running `fedcore.launch` started, by
    either start method: its children running `fedcore.run` (spawn), or its fork server's
    children (forkserver: they all bear the fork server's command line, so a test tells them
    apart by their sockets, `listening`, or by what they write). Linux: reads /proc."""
    pids = []
    for child in children(launcher):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "fedcore.deployment.forkserver" in cmdline:
            pids += children(child)
        elif "fedcore.run" in cmdline:
            pids.append(child)
    return pids


def listening(pids: list[int], port: int) -> list[int]:
    """Those of `pids` holding a TCP socket that listens on `port` (Linux: /proc/net/tcp*)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:   # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    holders = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    holders.append(pid)
                    break
            except OSError:
                pass
    return holders


def launch_course(procs, cfg: Path, out: Path, clients: int, timeout: float = 300) -> str:
    """`python -m fedcore.launch` for `cfg` (a server and its clients on loopback) writing to
    `out`; its log, once it exited 0 with every client finished and nothing refused."""
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, timeout) == 0, text(launcher)[-3000:]
    log = text(launcher)
    assert "refused" not in log, log[-3000:]
    for k in range(1, clients + 1):
        assert f"client {k}: course finished" in log, log[-3000:]
    return log


def assert_same_final_model(a: Path, b: Path, atol: float = 1e-6) -> None:
    """The final models two courses wrote to `a` and `b` agree entry by entry to `atol`."""
    import torch
    first = torch.load(a / "final_model.pt", weights_only=True)
    second = torch.load(b / "final_model.pt", weights_only=True)
    assert first.keys() == second.keys()
    for entry in first:
        assert torch.allclose(first[entry], second[entry], rtol=0, atol=atol), entry


# ---------------------------------------------------------------- certificates

def make_certs(folder: Path) -> dict[str, str]:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, made by the
    project's own generator (`fedcore.certs`); the calling test skips where the optional extra
    'certs' (cryptography) is missing."""
    from tests.conftest import need_extra
    need_extra("certs")
    from fedcore.certs import make_certificates
    files = make_certificates(folder, clients=1, days=2)
    return {"ca": str(files["ca"]), "server_cert": str(files["server_cert"]),
            "server_key": str(files["server_key"]), "client_cert": str(files["client_1_cert"]),
            "client_key": str(files["client_1_key"])}


def mapping_rss_kib(address: int) -> int:
    """Resident size (KiB) of this process's mapping that holds `address`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError("mapping not found")
