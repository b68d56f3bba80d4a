"""The fork server (fedcore/deployment/forkserver.py, which the deployment tests and
`fedcore.launch` start processes with): what it starts behaves as a fresh `python -m
fedcore.run` process would, as far as the tests can tell: its own pid, output, exit code and
signals."""
import os
import signal
import subprocess
import sys

import pytest

from tests.deploy_helpers import ROOT, Procs, _fork_server, run_fedcore, server_port, text, wait_exit, write_cfg

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("FEDCORE_TEST_FORKSERVER") == "0",
                                 reason="FEDCORE_TEST_FORKSERVER=0: every process is a fresh interpreter")]


def test_a_forked_run_has_its_own_pid_output_and_exit_code(tmp_path, procs: Procs):
    listing = procs.start("keys", ["-m", "fedcore.run", "--list-keys"])
    bad = procs.start("bad", ["-m", "fedcore.run", "--cfg", str(tmp_path / "missing.yaml")])
    assert wait_exit(listing, 60) == 0 and wait_exit(bad, 60) == 2
    assert type(listing).__name__ == "ForkedProcess"   # not a Popen: forked, not started afresh
    assert listing.pid not in (os.getpid(), bad.pid)
    assert "federate.client_num" in text(listing)
    assert "missing.yaml" in text(bad) and "federate.client_num" not in text(bad)


def test_a_forked_server_ignores_what_a_fresh_one_ignores_dies_of_sigkill_and_exits_130_on_ctrl_c(tmp_path, procs: Procs):
    cfg = write_cfg(tmp_path / "course.yaml", {"distribute.insecure": True, "distribute.token": "t"})
    servers = []
    for k in range(2):
        out = tmp_path / f"out{k}"
        servers.append(procs.fedcore(f"server{k}", cfg, "distribute.role=server",
                                     "distribute.server_port=0", f"outdir={out}"))
        server_port(out, servers[-1])   # listening: it waits for clients that never come
    killed, interrupted = servers
    # a Popen'ed one to compare with (any Popen keyword starts a fresh interpreter)
    fresh = procs.fedcore("fresh", cfg, "distribute.role=server", "distribute.server_port=0",
                          f"outdir={tmp_path / 'fresh'}", close_fds=True)
    server_port(tmp_path / "fresh", fresh)
    assert type(fresh).__name__ == "Popen"
    for forked in servers:   # the signals it ignores (SIGPIPE among them) are a fresh process's
        assert _ignored_signals(forked.pid) == _ignored_signals(fresh.pid)
    killed.kill()
    interrupted.send_signal(signal.SIGINT)
    assert wait_exit(killed, 30) == -signal.SIGKILL
    assert wait_exit(interrupted, 60) == 130, text(interrupted)[-2000:]   # Ctrl-C, documented
    assert "Traceback" not in text(interrupted)


def _ignored_signals(pid: int) -> str:
    status = open(f"/proc/{pid}/status").read()
    return next(line for line in status.splitlines() if line.startswith("SigIgn:"))


def test_a_forked_run_sees_the_pythonpath_its_test_gives_it(tmp_path, procs: Procs):
    # a fresh interpreter reads PYTHONPATH at start-up; the forked one was started before it
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "forkserver_probe_plugin.py").write_text(
        "from fedcore.kernel.config import declare\n"
        "declare('forkserver_probe.size', int, 7, 'a key only this plug-in declares')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")])}
    p = procs.start("probe", ["-m", "fedcore.run", "--help-key", "forkserver_probe.size",
                              "plugins=[forkserver_probe_plugin]"], env=env)
    assert wait_exit(p, 60) == 0, text(p)[-2000:]
    assert "forkserver_probe.size: int, default 7" in text(p)



def test_a_forked_run_imports_from_its_working_directory_as_python_m_does(tmp_path):
    # `python -m` puts the working directory first on sys.path: a plug-in beside the config
    # loads from there, in the forked process as in a fresh one
    (tmp_path / "cwd_probe_plugin.py").write_text(
        "from fedcore.kernel.config import declare\n"
        "declare('cwd_probe.size', int, 9, 'a key only this plug-in declares')\n")
    args = ["--help-key", "cwd_probe.size", "plugins=[cwd_probe_plugin]"]
    forked = run_fedcore(args, cwd=tmp_path, timeout=60)
    fresh = subprocess.run([sys.executable, "-m", "fedcore.run", *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert forked.returncode == fresh.returncode == 0, forked.stderr + fresh.stderr
    assert forked.stdout == fresh.stdout and "cwd_probe.size: int, default 9" in forked.stdout


def test_a_malformed_request_or_another_module_is_refused_and_the_server_goes_on():
    import socket

    # the fork server this test process's deployment tests use (started at its first use), not
    # one more: a server that did not go on would fail them too
    server = _fork_server()
    if server is None:
        pytest.skip("no fork server on this system")
    with open(os.devnull, "rb") as null:
        for payload in (b"not json\n", b'{"module": "os", "argv": []}\n', b"[1, 2]\n"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(server.path)
                socket.send_fds(s, [payload], [null.fileno()] * 3)
                assert s.recv(100) == b""   # closed without a child
    with pytest.raises(ValueError):
        server.spawn(["--list-keys"], module="os")
    r, w = os.pipe()
    p = server.spawn(["--help-key", "seed"], stdio=(0, w, w))
    os.close(w)
    out = b"".join(iter(lambda: os.read(r, 65536), b""))
    os.close(r)
    assert p.wait(60) == 0 and b"seed: int" in out, out
    assert server.proc.poll() is None


def test_a_child_runs_its_own_exit_finalizers_not_the_ones_it_inherited(tmp_path):
    # A child ends with `_exit`, which runs exit handlers; the server's finalizers (torch
    # unregistering each operator library) are not the child's to run, its own are.
    script = """
import os, sys, weakref
from pathlib import Path
from fedcore.deployment import forkserver
class Held: pass
out = Path(sys.argv[1])
servers = Held()
weakref.finalize(servers, (out / "server's").touch)
pid = os.fork()
if pid == 0:
    forkserver._forget_inherited_finalizers()
    own = Held()
    weakref.finalize(own, (out / "child's").touch)
    forkserver._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), sorted(p.name for p in out.iterdir()))
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    # the child made only its own file; the parent's finalizer runs at the parent's exit
    assert done.stdout.split("\n")[0] == "0 [\"child's\"]", done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child's", "server's"]


def test_a_server_forked_from_its_launcher_starts_children_that_write_as_they_go(tmp_path):
    # `ForkServer(from_here=True)` (what fedcore.launch uses) forks the server from this
    # process: its children must still write their lines at once (as PYTHONUNBUFFERED makes a
    # fresh server's), not when they end, although this process's stdout is a buffered file.
    (tmp_path / "stdout_plugin.py").write_text('print("a line on stdout")\n')   # printed at its import
    cfg = write_cfg(tmp_path / "course.yaml", {"distribute.insecure": True, "distribute.token": "t",
                                               "plugins": ["stdout_plugin"]})
    script = """
import os, sys, time
from fedcore.deployment.forkserver import ForkServer
cfg, out, log = sys.argv[1:]
server = ForkServer(from_here=True)
assert server.proc.pid != os.getpid() and type(server.proc).__name__ == "_ForkedFromHere"
fd = os.open(log, os.O_WRONLY | os.O_CREAT)
child = server.spawn(["--cfg", cfg, "federate.mode=distributed", "distribute.role=server",
                      "distribute.server_port=0", "outdir=" + out], stdio=(0, fd, fd))
deadline = time.monotonic() + 60
while not ("listening" in open(log).read() and "a line on stdout" in open(log).read()) and time.monotonic() < deadline:
    time.sleep(0.05)
print("seen" if "a line on stdout" in open(log).read() else "not seen", child.poll())
child.kill()
print("exit", child.wait(30))
server.close()
print("closed", server.proc.poll())
"""
    done = subprocess.run([sys.executable, "-c", script, str(cfg), str(tmp_path / "out"), str(tmp_path / "log")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},   # stdout buffered here
                               "PYTHONPATH": os.pathsep.join((str(ROOT), str(tmp_path)))})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "seen None", (lines, (tmp_path / "log").read_text()[-2000:])   # written while it runs
    assert lines[1] == f"exit {-signal.SIGKILL}" and lines[2] == f"closed {-signal.SIGKILL}", lines
