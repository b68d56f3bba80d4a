"""A fork server: one process imports torch, gRPC and fedcore once and forks every
`python -m fedcore.run` (or `fedcore.launch`) process asked of it.

A fresh deployed process spends about three seconds of CPU before it does anything: two
importing torch, gRPC and fedcore, one more importing `torch._dynamo` when its course builds
its first optimizer. `fedcore.launch` starts a server, its clients (and edges) on one machine,
and restarts them under `--restart`; forked from this process, each is still a process of its
own (its own pid, memory, sockets, signals and exit status; SIGKILL kills it alone), started
in milliseconds. The server only imports modules: it starts no thread, channel or server
before forking, so forking it is safe. Linux only (`available()`); elsewhere the launcher
starts fresh interpreters.

    python -m fedcore.deployment.forkserver SOCKET   # serves until its parent process exits

A request on the Unix socket SOCKET is one JSON line {"module", "argv", "env", "cwd",
"die_with_parent"} (`module` one of MODULES) sent with three descriptors (the child's stdin, stdout and stderr). The answer is a JSON line
{"pid": ...} once the child runs, then {"returncode": ...} when it exits, in
`subprocess.Popen`'s convention (a negative number is the signal that ended it).
`ForkServer.spawn` returns a `ForkedProcess`, which the launcher uses as it uses a Popen.
"""
from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

__all__ = ["available", "ForkServer", "ForkedProcess", "ForkServerGone"]

MODULES = ("fedcore.run", "fedcore.launch")   # what it runs, as `python -m` does
# what a deployed course imports; numpy.ma is np.unique's first import (a data split's);
# sklearn.datasets where installed: the shipped tables (digits, the quickstart's) load through it
PRELOAD = ("grpc", "numpy", "numpy.ma", "torch", "torch._dynamo", "yaml", "fedcore.deployment.distributed",
           "fedcore.comm.grpc_server", "fedcore.comm.grpc_client", "sklearn.datasets", *MODULES)
_PR_SET_PDEATHSIG = 1
SOCKET_PATH_MAX = 107   # bytes of a Unix socket's path on Linux (sun_path, less its final NUL)


class ForkServerGone(RuntimeError):
    """The fork server ended: it can start no more processes."""


def available() -> bool:
    """Whether this system can fork a process that imported torch (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "send_fds")


def _preload() -> None:
    """What every child would import first, imported once for all of them: the built-in
    plug-ins too, and torch._dynamo, which torch imports at a course's first optimizer."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:   # a torch without _dynamo, no scikit-learn: each child imports what it needs
            pass
    from fedcore.kernel.registry import load_builtin
    load_builtin()


def _die_with(parent: int) -> None:
    """SIGTERM this process when `parent` (the fork server) ends, at once if it already did."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _child(request: dict, fds: list[int], parent: int, closing: list) -> None:
    """In the forked child: become `python -m MODULE ARGV`; never returns."""
    for sock in closing:
        sock.close()
    # the server changed only SIGINT; the rest is as Python starts any process (SIGPIPE ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("die_with_parent"):
        _die_with(parent)
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None   # found again from this environment (TMPDIR), not the server's
    os.chdir(request["cwd"])
    # as `python -m` starts: the working directory first, then PYTHONPATH (read at start-up by
    # a fresh interpreter: one other than the server's still counts)
    sys.path[0] = os.getcwd()
    extra = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and d not in sys.path]
    sys.path[1:1] = extra
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    _forget_inherited_finalizers()
    import random

    import numpy as np
    random.seed()              # not the server's state, shared by every child
    np.random.seed()
    import runpy
    module = request["module"]
    sys.modules.pop(module, None)   # run as __main__, as `python -m` does, not beside the server's copy
    sys.argv = [module, *request["argv"]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    _exit(code)


def _forget_inherited_finalizers() -> None:
    """The server's exit finalizers (`weakref.finalize`, e.g. torch unregistering each operator
    library it imported) undo the server's imports; a child ending with `_exit` need not run
    them (a twentieth of a second each time). The child's own finalizers still run."""
    for finalizer in list(getattr(weakref.finalize, "_registry", ())):
        finalizer.atexit = False


def _exit(code: int) -> None:
    """End the child as a fresh process ends, less the interpreter's teardown: it waits for
    its threads and runs its exit handlers (logging's flush among them), but does not tear
    down every module it inherited, which touches the whole inherited heap (copy on write)
    and took about a second per process. multiprocessing's forked children end so too."""
    import atexit
    import threading
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(path: str) -> int:
    """The server's loop; returns when its parent is gone (a forked child never returns)."""
    _preload()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C is for the parent to act on
    parent, me = os.getppid(), os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}   # child pid -> the connection told when it exits
    conns: list[socket.socket] = []
    buffers: dict[socket.socket, tuple[bytes, list[int]]] = {}
    print("ready", flush=True)
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *conns], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                conns.append(conn)
                buffers[conn] = (b"", [])
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 3)
            held, held_fds = buffers[sock]
            held, held_fds = held + data, held_fds + fds
            buffers[sock] = (held, held_fds)
            if not data or (b"\n" in held and len(held_fds) != 3):   # gone, or a malformed request
                conns.remove(sock)
                buffers.pop(sock)
                for fd in held_fds:
                    os.close(fd)
                sock.close()
                continue
            if b"\n" not in held:
                continue
            conns.remove(sock)
            buffers.pop(sock)
            try:
                request = json.loads(held.split(b"\n", 1)[0])
                request.setdefault("module", MODULES[0])
            except (ValueError, AttributeError):
                request = {"module": None}
            if request["module"] not in MODULES:   # it runs fedcore's entry points, nothing else
                for fd in held_fds:
                    os.close(fd)
                sock.close()
                continue
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, held_fds, me, [listener, *conns, *waiting.values(), sock])
            for fd in held_fds:
                os.close(fd)
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


class ForkedProcess:
    """A child of the fork server, used as a `subprocess.Popen` is (pid, poll, wait, signals).
    If the server dies, its children die with it (SIGTERM, `die_with_parent`) and each reads as
    killed by that signal."""

    def __init__(self, path: str, module: str, argv: list[str], env: dict, cwd: str,
                 stdio: tuple[int, int, int], die_with_parent: bool):
        self.args = argv
        self.returncode: int | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buffer = b""
        try:
            self._sock.connect(path)
            request = {"module": module, "argv": argv, "env": env, "cwd": cwd,
                       "die_with_parent": die_with_parent}
            payload = json.dumps(request).encode() + b"\n"
            sent = socket.send_fds(self._sock, [payload], list(stdio))
            if sent < len(payload):
                self._sock.sendall(payload[sent:])
            answer = self._read_line(None)
        except OSError as exc:
            self._sock.close()
            raise ForkServerGone(f"the fork server is gone ({exc})") from None
        if answer is None:
            self._sock.close()
            raise ForkServerGone("the fork server is gone")
        self.pid = answer["pid"]

    def _read_line(self, timeout: float | None) -> dict | None:
        """The next answer; None at `timeout`; {"returncode": -SIGTERM} if the server vanished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            poller = select.poll()   # not select(): a process may hold more than 1024 descriptors
            poller.register(self._sock, select.POLLIN)
            if not poller.poll(None if left is None else left * 1000):
                return None
            try:
                data = self._sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                return {"returncode": -signal.SIGTERM} if hasattr(self, "pid") else None
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


class _ForkedFromHere:
    """The fork server as a fork of this process, used as the Popen it replaces (pid, poll,
    wait, kill, stdout). Where this process already imported what the server preloads (a
    launcher itself forked from a fork server), no interpreter starts and nothing is imported
    twice: about three seconds of CPU less. This process must run no thread but the main one."""

    def __init__(self, path: str, preexec_fn) -> None:
        read, write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.pid = os.fork()
        if self.pid == 0:   # the server: as a fresh one starts (stdin empty, stdout the pipe)
            code = 1
            try:
                if preexec_fn is not None:
                    preexec_fn()
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(write, 1)
                os.closerange(3, _max_fd())
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                # unbuffered, as PYTHONUNBUFFERED makes it: children write their lines as they go
                # (the inherited objects stay as sys.__stdout__ and sys.__stderr__, never closed)
                sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
                sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                              errors="backslashreplace")
                code = serve(path)
            finally:
                os._exit(code)
        os.close(write)
        self.stdout = os.fdopen(read, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = _returncode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and timeout is None:
            self.returncode = _returncode(os.waitpid(self.pid, 0)[1])
        deadline = time.monotonic() + (timeout or 0.0)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["fork server"], timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536


class ForkServer:
    """A fork server of this process (which must outlive its children), started at once;
    `preexec_fn` as for Popen (the launcher's makes it die with the launcher). With
    `from_here`, the server is a fork of this process where it runs no other thread
    (`_ForkedFromHere`), else a fresh interpreter."""

    def __init__(self, env: dict | None = None, cwd: str | None = None, preexec_fn=None,
                 from_here: bool = False):
        self.folder = tempfile.mkdtemp(prefix="fedcore-forkserver-")   # mode 0700: ours alone
        if len(os.fsencode(self.folder)) > SOCKET_PATH_MAX - len("/socket"):   # a deep TMPDIR
            os.rmdir(self.folder)
            self.folder = tempfile.mkdtemp(prefix="fedcore-forkserver-", dir="/tmp")
        self.path = os.path.join(self.folder, "socket")
        env = dict(os.environ if env is None else env)
        env["PYTHONUNBUFFERED"] = "1"   # its children write their lines as they go
        if from_here and threading.active_count() == 1:   # each child gets its env and cwd anyway
            self.proc = _ForkedFromHere(self.path, preexec_fn)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "fedcore.deployment.forkserver", self.path],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, cwd=cwd,
                                         preexec_fn=preexec_fn)
        if self.proc.stdout.readline().strip() != b"ready":
            self.close()
            raise ForkServerGone(f"the fork server did not start (exit status {self.proc.poll()})")

    def spawn(self, argv: list[str], env: dict | None = None, cwd: str | None = None,
              stdio: tuple[int, int, int] = (0, 1, 2), die_with_parent: bool = False,
              module: str = MODULES[0]) -> ForkedProcess:
        """Fork `python -m MODULE ARGV` (MODULE one of MODULES) with `env` (default: this
        process's), in `cwd`, with `stdio` as its stdin, stdout and stderr descriptors
        (default: this process's)."""
        if module not in MODULES:
            raise ValueError(f"the fork server runs {', '.join(MODULES)}, not {module}")
        return ForkedProcess(self.path, module, argv, dict(os.environ if env is None else env),
                             cwd or os.getcwd(), stdio, die_with_parent)

    def close(self) -> None:
        """End the server (children it started and that asked to die with it get SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
