"""`python -m fedcore.launch --cfg X --clients N [KEY=VALUE ...]`: a whole deployment on loopback.

Starts a server on 127.0.0.1 (on a free port) and N client processes that
dial it, waits for the server, and exits with the server's status. For demos
and tests; across machines, start each role with `python -m fedcore.run`.
Without configured tokens it makes one random token per client: the server
reads them from a private file (mode 0600, deleted at the end) and each client
gets its own in the environment (FEDCORE_TOKEN), so no token appears on a
command line or in the run's outputs. A secure-aggregation course without a roster gets
one the same way: a signing key per client (its own file, passed to that client only)
and the roster of their public keys, all deleted at the end. Without TLS configured it runs
plaintext on loopback (`distribute.insecure: true`, with one warning for the whole launch).
Ctrl-C stops every process it started.

Its processes never outlive it, however it ends: on Linux each child asks the
kernel for SIGTERM when the launcher dies (`prctl(PR_SET_PDEATHSIG)`), and on
every system a guardian process (`fedcore/deployment/launch_guard.py`), started first,
watches a pipe from the launcher whose end the kernel closes even on SIGKILL:
it then removes the tokens folder and ends the processes the launcher started.

`--restart N` restarts a process that died abnormally (killed by a signal: SIGKILL, a
crash, the OOM killer; or exit status 1, an unexpected error, or 4, a client that gave up
on its server) up to N times each, after 1 s, then 2, 4, ... (at most 30 s) for each
further restart of that process. A client is started again with the same arguments (it
loads its state from its state folder, `fedcore.comm.client_state`); the server is started again
on the same port with `resume_from=latest`, so the clients reconnect to the resumed course;
from its death until the new one listens, the launch's clients do not count the time against
their `distribute.retry_timeout` (`fedcore.comm.restart_notice`).
A configuration error (status 2), an interrupt (130) and a course's own outcomes (3, 5, 6)
are not restarted.

By default (`--start-method auto`) on Linux each process is forked from a fork server
(`fedcore/deployment/forkserver.py`) that imported torch, gRPC and fedcore once: N clients
cost one import (about three seconds of CPU) instead of N, and a restart takes milliseconds.
Each is still a process of its own (pid, memory, signals, exit status), but a child of the
fork server, and `ps` shows the fork server's command line for it (the fork server is a fork
of the launcher: its command line is the launcher's). A laptop of 2 cores holds a course of
30 clients this way, where 30 fresh interpreters importing torch at once run no round for
minutes. Elsewhere than on Linux, and with `--start-method spawn`, each process is a fresh
interpreter, a child of the launcher with its own command line; `--start-method forkserver`
where it is not available says so in one line and spawns.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedcore.comm.restart_notice import RestartNotice
from fedcore.comm.stream import INSECURE_NOTED_ENV, INSECURE_WARNING, TOKEN_ENV, write_secret
from fedcore.kernel.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_SERVER_GONE, LAUNCHED_ENV, FedcoreError
from fedcore.kernel.files import make_folder, set_private
from fedcore.run import RESUME_COMMAND_ENV

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedcore.launch",
                                description="Run a server and N clients as processes on loopback.")
    p.add_argument("--cfg", required=True, help="the course's YAML config")
    p.add_argument("--clients", type=int, default=None,
                   help="client processes to start (default: federate.client_num)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds to wait for the server to listen")
    p.add_argument("--server-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the server only (e.g. its distribute.tls.cert); repeatable")
    p.add_argument("--client-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every client only; repeatable")
    p.add_argument("--restart", type=int, default=0, metavar="N",
                   help="restart a server or client that died abnormally (a signal, or exit status "
                        "1 or 4) up to N times each, after 1, 2, 4, ... s (at most 30 s); a restarted "
                        "server resumes the course (resume_from=latest)")
    p.add_argument("--start-method", choices=("auto", "spawn", "forkserver"), default="auto",
                   help="forkserver (Linux): each process is forked from one process that imported "
                        "torch, gRPC and fedcore once, which saves about three seconds of CPU per "
                        "process; spawn: each is a fresh interpreter; auto (the default): forkserver "
                        "where available, else spawn")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return p


RESTARTED_STATUSES = (EXIT_FAILURE, EXIT_SERVER_GONE)   # besides death by a signal
BACKOFF_MAX_S = 30.0


def abnormal(rc: int) -> bool:
    """Whether a process's exit status is a death worth a restart (see the module's doc)."""
    return rc < 0 or rc in RESTARTED_STATUSES


def restart_delay(restarts_done: int) -> float:
    """Seconds before a process's restart number `restarts_done` + 1: 1, 2, 4, ... at most 30."""
    return min(BACKOFF_MAX_S, 2.0 ** restarts_done)


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


class _Supervised:
    """One process of the launch: its command, and its restarts under `--restart`."""

    def __init__(self, name: str, start, guardian: "_Guardian", budget: int):
        self.name, self._start, self.guardian, self.budget = name, start, guardian, budget
        self.restarts = 0
        self.due: float | None = None    # when its pending restart is due
        self.ended: int | None = None    # its exit status once it ended for good
        self.proc = guardian.watch(start(first=True))

    def check(self, now: float) -> int | None:
        """Restart it if it died abnormally and restarts are left (when due); its exit status
        if it ended for good, else None."""
        if self.due is not None:
            if now >= self.due:
                self.due = None
                self.restarts += 1
                self.proc = self.guardian.watch(self._start(first=False))
            return None
        rc = self.proc.poll()
        if rc is None:
            return None
        if not abnormal(rc) or self.restarts >= self.budget:
            if abnormal(rc) and self.budget and self.ended is None:
                print(f"fedcore.launch: {self.name} died ({_how(rc)}); no restarts left (--restart "
                      f"{self.budget})", file=sys.stderr, flush=True)
            self.ended = rc
            return rc
        delay = restart_delay(self.restarts)
        print(f"fedcore.launch: {self.name} died ({_how(rc)}); restart {self.restarts + 1} of "
              f"{self.budget} in {delay:g}s", file=sys.stderr, flush=True)
        self.due = now + delay
        return None


def _kill_all(children: list["_Supervised"]) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.kill()


def _interrupt(*_args) -> None:
    """SIGTERM to the launcher: the orderly stop of Ctrl-C."""
    raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen], sig: int, wait: float) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Guardian:
    """The guardian process (`fedcore.deployment.launch_guard`): told each child's pid, and `done` once
    the launcher has stopped them itself; if the launcher dies first, the guardian acts."""

    def __init__(self):
        script = Path(__file__).parent / "deployment" / "launch_guard.py"
        self.proc = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                                     text=True, start_new_session=True)

    def _say(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the guardian is gone: the launcher still works
            pass

    def secrets(self, folder: Path) -> Path:
        self._say(f"secrets {folder}")
        return folder

    def watch(self, proc: subprocess.Popen) -> subprocess.Popen:
        self._say(f"pid {proc.pid}")
        return proc

    def release(self) -> None:
        self._say("done")
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _die_with_parent():
    """A `preexec_fn` for Linux: SIGTERM this child when the launcher's thread ends (and at
    once if the launcher died before the child got this far); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


class _Starter:
    """Starts the launch's `python -m fedcore.run` processes: forked from a fork server where
    asked and available, else (or once that server is gone, said in one line) fresh."""

    def __init__(self, method: str, preexec):
        from fedcore.deployment import forkserver
        self.preexec, self.server, self._gone = preexec, None, forkserver.ForkServerGone
        if method == "spawn" or (method == "auto" and not forkserver.available()):
            return
        if not forkserver.available():
            print("fedcore.launch: --start-method forkserver needs Linux; starting fresh interpreters",
                  file=sys.stderr, flush=True)
            return
        try:
            self.server = forkserver.ForkServer(preexec_fn=preexec, from_here=True)
        except forkserver.ForkServerGone as exc:
            print(f"fedcore.launch: {exc}; starting fresh interpreters", file=sys.stderr, flush=True)

    def watch(self, guardian: "_Guardian") -> None:
        """Tell the guardian of the fork server and its socket's folder."""
        if self.server is not None:
            guardian.watch(self.server.proc)
            guardian.secrets(Path(self.server.folder))

    def start(self, argv: list[str], env: dict | None = None):
        """`argv` is [python, -m, fedcore.run, ...]."""
        if self.server is not None:
            try:
                return self.server.spawn(argv[3:], env, die_with_parent=self.preexec is not None)
            except self._gone as exc:
                print(f"fedcore.launch: {exc}; starting fresh interpreters", file=sys.stderr, flush=True)
                self.close()
        return subprocess.Popen(argv, env=env, preexec_fn=self.preexec)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # overrides may follow --check etc.
    try:
        signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread (embedded use): leave signals alone
        pass
    from fedcore.kernel.config import load_config
    from fedcore.api import resolve_outdir
    try:
        cfg = load_config(args.cfg, [*args.overrides, *args.server_opt])
    except FedcoreError as exc:
        print(f"fedcore: {exc}", file=sys.stderr)
        return exc.exit_code
    default = cfg["vertical.parties"] - 1 if cfg["data.partition"] == "vertical" else cfg["federate.client_num"]
    n = args.clients if args.clients is not None else default   # a vertical course: its passive parties
    if n < 1:
        print("fedcore: usage: --clients must be >= 1", file=sys.stderr)
        return EXIT_CONFIG
    # resume_from is the server's: a client resumes through it (from its own saved state)
    resume = [o for o in args.overrides if o.startswith("resume_from=")]
    args.overrides = [o for o in args.overrides if not o.startswith("resume_from=")]
    own = argv if argv is not None else sys.argv[1:]
    resume_command = json.dumps(   # what the server prints to resume: this launch
        [sys.executable, "-m", "fedcore.launch", *[a for a in own if not a.startswith(("outdir=", "resume_from="))]])
    outdir = resolve_outdir(cfg).resolve()
    set_private(cfg["outputs.private"])
    make_folder(outdir)
    address_file = outdir / "server_address"
    address_file.unlink(missing_ok=True)
    common = ["federate.mode=distributed", f"federate.client_num={n}", f"outdir={outdir}",
              "distribute.server_host=127.0.0.1"]
    server_extra: list[str] = list(resume)
    if cfg["distribute.max_streams_per_connection"] is None:
        # every client (and edge) it starts has a process, so a connection of its own that needs
        # at most 3 calls: a flooding connection gets no more than that (docs/deployment.md)
        server_extra.append("distribute.max_streams_per_connection=4")
    os.environ[LAUNCHED_ENV] = "1"   # every process inherits it: one `interrupted` line, the launcher's
    guardian = _Guardian()  # before anything it would have to clean up
    notice = RestartNotice(guardian.secrets(Path(tempfile.mkdtemp(prefix="fedcore-launch-"))))  # mode 0700
    os.environ.update(notice.env)   # its clients wait for a server it restarts (and its edges)
    client_env: dict[int, dict] = {k: dict(os.environ) for k in range(1, n + 1)}
    secrets_dir = None
    tree = None
    if cfg["topology.edges"]:   # a hierarchical course: edge processes between server and clients
        from fedcore.deployment.launch_tree import LaunchTree
        try:
            tree = LaunchTree(cfg, n)
        except FedcoreError as exc:
            print(f"fedcore: {exc}", file=sys.stderr)
            return exc.exit_code
    if not any(cfg[k] for k in ("distribute.token", "distribute.tokens", "distribute.token_file",
                                "distribute.tokens_file")) and not os.environ.get(TOKEN_ENV):
        tokens = {k: secrets.token_hex(16) for k in range(1, n + 1)}
        secrets_dir = guardian.secrets(Path(tempfile.mkdtemp(prefix="fedcore-tokens-")))  # mode 0700
        cloud_tokens = tree.tokens(tokens, secrets_dir) if tree else tokens
        server_extra.append(f"distribute.tokens_file={write_private(secrets_dir / 'tokens.yaml', cloud_tokens)}")
        for k, token in tokens.items():
            client_env[k][TOKEN_ENV] = token
    client_extra: dict[int, list[str]] = {k: [] for k in range(1, n + 1)}
    keys_dir = None
    if cfg["secure_aggregation.enabled"] and not cfg["secure_aggregation.roster"]:
        # the operator's part: one signing key per client and the roster of their public keys
        from fedcore.kernel.registry import components
        write_roster = components.get("secagg_roster")
        keys_dir = guardian.secrets(Path(tempfile.mkdtemp(prefix="fedcore-secagg-")))  # mode 0700
        roster, key_files = write_roster(keys_dir, list(range(1, n + 1)))
        common.append(f"secure_aggregation.roster={roster}")
        for k, path in key_files.items():
            client_extra[k].append(f"secure_aggregation.signing_key={path}")
    if not cfg["distribute.tls.cert"] and not cfg["distribute.insecure"]:
        common.append("distribute.insecure=true")
    if not cfg["distribute.tls.cert"] or cfg["distribute.insecure"]:
        # one warning for the whole launch, not one per process
        print(f"fedcore.launch: {INSECURE_WARNING} (loopback)", file=sys.stderr, flush=True)
        os.environ[INSECURE_NOTED_ENV] = "1"   # the server inherits it
        for env in client_env.values():
            env[INSECURE_NOTED_ENV] = "1"
    base = [sys.executable, "-m", "fedcore.run", "--cfg", args.cfg, *args.overrides, *common]
    preexec = _die_with_parent()
    starter = _Starter(args.start_method, preexec)
    starter.watch(guardian)
    from fedcore.deployment import forkserver, launch_capacity as cap
    warning = cap.crowding(1 + n + (cfg["topology.edges"] or 0), starter.server is None, forkserver.available(),
                           cap.cores(), cap.available_mb())
    if warning:
        print(warning, file=sys.stderr, flush=True)
    port = "0"
    ports: dict[int, str] = {}   # with edges: the port of each client's edge
    if cfg.source("distribute.server_port") != "default":
        print(f"fedcore.launch: distribute.server_port={cfg['distribute.server_port']} ignored: the launcher "
              "gives its server a free loopback port (written to server_address)", file=sys.stderr, flush=True)

    def start_server(first: bool) -> subprocess.Popen:
        again = [] if first else ["resume_from=latest"]   # the same course, on the same port
        return starter.start(base + args.server_opt + server_extra + again + [
            "distribute.role=server", f"distribute.server_port={port}"],
            {**os.environ, RESUME_COMMAND_ENV: resume_command})

    def client_starter(k: int):
        def start(first: bool) -> subprocess.Popen:
            return starter.start(base + args.client_opt + client_extra[k] + [
                "distribute.role=client", f"distribute.client_id={k}", f"distribute.server_port={ports.get(k, port)}"],
                client_env[k])
        return start

    children: list[_Supervised] = []
    try:
        server = _Supervised("the server", start_server, guardian, args.restart)
        children.append(server)
        deadline = time.monotonic() + args.startup_timeout
        while not address_file.exists():
            if server.proc.poll() is not None:
                return server.proc.returncode
            if time.monotonic() > deadline:
                print(f"fedcore: the server did not listen within {args.startup_timeout:g}s", file=sys.stderr)
                return EXIT_FAILURE
            time.sleep(0.1)
        port = address_file.read_text().strip().rsplit(":", 1)[1]
        if tree is not None:   # each client dials its edge
            if not tree.start(base + args.server_opt, port, outdir, starter.start, args.startup_timeout,
                              lambda name, start: _Supervised(name, start, guardian, args.restart), children):
                return EXIT_FAILURE
            ports.update(tree.client_ports)
        clients = [_Supervised(f"client {k}", client_starter(k), guardian, args.restart)
                   for k in range(1, n + 1)]
        children += clients
        rc = None
        while rc is None:
            now = time.monotonic()
            rc = server.check(now)
            if server.due is not None and not notice.active:   # dead, to be started again
                address_file.unlink(missing_ok=True)
                notice.begin()
            elif notice.active and server.due is None and address_file.exists():   # it listens again
                notice.end()
            for child in children[1:]:
                child.check(now)
            if rc is None and all(c.ended not in (None, 0) for c in clients):
                # no client is left to join, and none finished: the server would wait for ever
                codes = sorted({c.ended for c in clients})
                print(f"fedcore.launch: every client ended ({', '.join(_how(c) for c in codes)}); "
                      "stopping the server", file=sys.stderr, flush=True)
                rc = EXIT_CONFIG if EXIT_CONFIG in codes else EXIT_FAILURE
            time.sleep(0.1)
        # a finished course's clients get its end and leave on their own; after a server that
        # failed for good they would only wait for it, so they are stopped at once
        grace = time.monotonic() + (15.0 if rc == 0 else 0.0)
        for child in children[1:]:
            try:
                child.proc.wait(max(0.0, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return rc
    except KeyboardInterrupt:
        # stopping: SIGTERM again is ignored, Ctrl-C again stops every process at once
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, lambda *_: _kill_all(children))
        _stop([c.proc for c in children], signal.SIGINT, 10.0)
        print("fedcore: interrupted", file=sys.stderr)
        return 130
    finally:
        _stop([c.proc for c in children], signal.SIGTERM, 5.0)
        starter.close()
        for folder in (secrets_dir, keys_dir, notice.path.parent):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        guardian.release()


def write_private(path: Path, tokens: dict[int, str]) -> Path:
    """Write the tokens file readable by its owner only (created 0600, never wider)."""
    import yaml
    return write_secret(path, yaml.safe_dump(tokens))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
