"""A process that has imported torch, gRPC and fedcore once, and forks `python -m fedcore.run`
processes for the deployment tests.

A deployed process spends about two seconds of CPU importing torch, gRPC and fedcore before it
does anything; the deployment tests start hundreds of them. Forked from this process, each is
still a real process of its own (its own pid, memory, sockets and signals; SIGKILL kills it),
started in milliseconds. The zygote imports modules only: it creates no thread, channel or
server, so forking it is safe.

    python -m tests.zygote SOCKET     # serves until its parent (the pytest worker) exits

A request is one JSON line on SOCKET: {"argv", "env", "cwd", "log"}; the answer is a JSON line
{"pid": ...} once the child runs, then {"returncode": ...} when it exits, in
`subprocess.Popen`'s convention (a negative number is the signal that ended it).
`tests.deploy_helpers.Procs` uses it through `ZygoteProcess`, which looks like a Popen.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

MODULE = "fedcore.run"


def _preload() -> None:
    """What every child would import first, imported once here for all of them."""
    import importlib
    for name in ("grpc", "numpy", "torch", "yaml", "fedcore.deployment.distributed", MODULE):
        importlib.import_module(name)


def _child(request: dict, listener: socket.socket, conns: list) -> int:
    """In the forked child: become `python -m fedcore.run ARGV` and return its exit code."""
    listener.close()
    for c in conns:
        c.close()
    # the zygote changed only SIGINT; the rest is as Python starts any process (SIGPIPE ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # read at start-up by a fresh interpreter: a PYTHONPATH other than the zygote's still counts
    extra = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and d not in sys.path]
    sys.path[1:1] = extra
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    import random

    import numpy as np
    random.seed()              # not the zygote's state, shared by every child
    np.random.seed()
    import runpy
    sys.modules.pop(MODULE, None)   # run as __main__, as `python -m` does, not beside the zygote's copy
    sys.argv = [MODULE, *request["argv"]]
    try:
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    return code


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(path: str) -> int:
    """The zygote's loop; returns in the zygote when its parent is gone, and in a forked child
    with the child's exit code."""
    _preload()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C of pytest is not ours to act on
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}   # child pid -> the connection told when it exits
    conns: list[socket.socket] = []
    buffers: dict[socket.socket, bytes] = {}
    print("ready", flush=True)
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *conns], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                conns.append(conn)
                buffers[conn] = b""
                continue
            data = sock.recv(65536)
            if not data:
                conns.remove(sock)
                buffers.pop(sock)
                continue
            buffers[sock] += data
            if b"\n" not in buffers[sock]:
                continue
            request = json.loads(buffers[sock].split(b"\n", 1)[0])
            conns.remove(sock)
            buffers.pop(sock)
            pid = os.fork()
            if pid == 0:
                return _child(request, listener, [*conns, *waiting.values()])
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = sock
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"returncode": _returncode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    return 0


class ZygoteProcess:
    """A child of the zygote, as the tests use a `subprocess.Popen`."""

    def __init__(self, path: str, argv: list[str], env: dict, cwd: str, log: str):
        self.args = argv
        self.returncode: int | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._sock.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}).encode() + b"\n")
        self._buffer = b""
        self.pid = self._read_line(None)["pid"]

    def _read_line(self, timeout: float | None) -> dict | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            poller = select.poll()   # not select(): a test may hold more than 1024 descriptors
            poller.register(self._sock, select.POLLIN)
            if not poller.poll(None if left is None else left * 1000):
                return None
            data = self._sock.recv(4096)
            if not data:
                raise RuntimeError("the zygote went away")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            answer = self._read_line(timeout)
            if answer is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = answer["returncode"]
            self._sock.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:   # never a pid the system may have given to another process
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote of this test process, started at first use."""

    def __init__(self, directory: str, env: dict, cwd: str):
        self.path = os.path.join(directory, "zygote.sock")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.path],
                                     stdout=subprocess.PIPE, env=env, cwd=cwd)
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the test zygote did not start")

    def spawn(self, argv: list[str], env: dict, cwd: str, log: str) -> ZygoteProcess:
        return ZygoteProcess(self.path, argv, env, cwd, log)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
