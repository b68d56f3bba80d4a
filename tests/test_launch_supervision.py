"""`fedcore.launch` never leaves processes or secrets behind, even when it is SIGKILLed."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedcore.deployment.launch_guard import _alive
from tests.deploy_helpers import ROOT, launched, text, wait_exit, wait_for, write_cfg
from tests.test_deploy_secrets import _children

SPAWN = ["--start-method", "spawn"]   # launches whose processes the test finds by their command lines


def test_a_launch_forks_its_processes_from_a_fork_server_by_default_where_it_can():
    """30 fresh interpreters importing torch at once hold a 2-core laptop for minutes: the default
    start method forks them from one that imported it (`fedcore.launch --start-method auto`)."""
    from fedcore.deployment import forkserver
    from fedcore.launch import _parser, _Starter
    assert _parser().parse_args(["--cfg", "c.yaml"]).start_method == "auto"
    assert _Starter("spawn", None).server is None
    starter = _Starter("auto", None)
    try:
        assert (starter.server is not None) == forkserver.available()
    finally:
        starter.close()

GUARD = [sys.executable, "-I", str(ROOT / "fedcore" / "deployment" / "launch_guard.py")]


def _cmdline(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}") / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_sigkill_of_the_launcher_ends_its_processes_and_removes_its_tokens(procs, tmp_path, method):
    cfg = write_cfg(tmp_path / "course.yaml", {
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.3,
        "federate.client_num": 2, "federate.total_round_num": 10000, "eval.clients": False})
    out = tmp_path / "out"
    temp = tmp_path / "temp"
    temp.mkdir()
    launcher = procs.start("launch", ["-m", "fedcore.launch", "--start-method", method, "--cfg", str(cfg),
                                      f"outdir={out}"], env={"TMPDIR": str(temp)})
    metrics = out / "metrics.jsonl"
    wait_for(lambda: launcher.poll() is None and metrics.exists() and metrics.read_text().count("\n") >= 2,
             240, "two rounds of the launched course")
    assert launcher.poll() is None, text(launcher)[-3000:]
    children = _children(launcher.pid)
    tokens = list(temp.glob("fedcore-tokens-*"))
    guardians = [p for p in children if "launch_guard.py" in _cmdline(p)]
    if method == "forkserver":   # the course's processes are the fork server's children
        servers = [p for p in children if p not in guardians]   # a fork of the launcher
        assert len(servers) == 1, text(launcher)[-3000:]
        server = servers[0]
        courses = _children(server)
        children += courses
        sockets = sorted(set(_unix_sockets_of(server)))   # its listener and the connections it accepted
        assert len(sockets) == 1 and "fedcore-forkserver-" in sockets[0], (sockets, text(launcher)[-3000:])
        socket_folder = Path(sockets[0]).parent
        assert (socket_folder / "socket").exists()
    else:
        courses = [p for p in children if "fedcore.run" in _cmdline(p)]
    assert len(courses) == 3 and len(guardians) == 1 and len(tokens) == 1  # server, 2 clients
    assert (tokens[0] / "tokens.yaml").is_file()
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        # safety nets only: they end at once (death signal, guardian), slower on a loaded machine
        wait_for(lambda: not tokens[0].exists(), 60, "the tokens folder to be removed")
        wait_for(lambda: not any(_alive(p) for p in children), 60, "every child of the launcher to end")
    finally:
        for p in children:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    rounds = metrics.read_text().count("\n")
    time.sleep(1.0)
    assert metrics.read_text().count("\n") == rounds  # the course is over, not going on as orphans
    if method == "forkserver":   # the fork server's socket and its folder removed too
        assert not socket_folder.exists()


def _unix_sockets_of(pid: int) -> list[str]:
    """The paths of the Unix sockets that process `pid` holds, one per socket (/proc/net/unix, by inode)."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    rows = [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]
    return [row[7] for row in rows if len(row) >= 8 and f"socket:[{row[6]}]" in held]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_guardian_alone_ends_the_processes_and_removes_the_secrets_when_its_pipe_closes(tmp_path):
    """The portable half, without the Linux death signal: the pipe's end is what it acts on."""
    secrets = tmp_path / "fedcore-tokens-x"
    secrets.mkdir()
    (secrets / "tokens.yaml").write_text("1: abc\n")
    child = _sleeper()
    try:
        guard = subprocess.Popen(GUARD, stdin=subprocess.PIPE, text=True, start_new_session=True)
        guard.stdin.write(f"secrets {secrets}\npid {child.pid}\n")
        guard.stdin.close()  # as the kernel does when the launcher dies, without "done"
        assert guard.wait(15) == 0
        assert child.wait(5) == -signal.SIGTERM
        assert not secrets.exists()
    finally:
        child.kill()
        child.wait()


def test_the_guardian_leaves_processes_alone_after_done(tmp_path):
    secrets = tmp_path / "fedcore-tokens-y"
    secrets.mkdir()
    child = _sleeper()
    try:
        guard = subprocess.Popen(GUARD, stdin=subprocess.PIPE, text=True, start_new_session=True)
        guard.communicate(f"secrets {secrets}\npid {child.pid}\ndone\n", timeout=15)
        assert guard.returncode == 0 and not secrets.exists()
        time.sleep(0.3)
        assert child.poll() is None  # the launcher stopped its processes itself: nothing to end
    finally:
        child.kill()
        child.wait()


def test_a_server_refuses_an_outdir_holding_another_runs_records(procs, tmp_path):
    from fedcore.kernel.errors import ConfigError
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg
    out = tmp_path / "out"
    Course(small_cfg(out)).run()
    with pytest.raises(ConfigError, match="holds another run's records"):
        Course(small_cfg(out)).run()                   # a simulation refuses to replace them too
    before = (out / "metrics.jsonl").read_bytes()      # an earlier run's records: 2 rounds
    assert before.count(b"\n") == 2
    cfg = write_cfg(tmp_path / "course.yaml")
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           "distribute.insecure=true", "distribute.token=t", f"outdir={out}")
    assert server.wait(120) == 2
    lines = text(server).strip().splitlines()
    assert lines[-1] == (f"fedcore: outdir: '{out}' holds another run's records (metrics.jsonl); choose "
                         "a new outdir, or set outdir_overwrite=true to replace them")
    assert (out / "metrics.jsonl").read_bytes() == before and not (out / "server_address").exists()


def test_outdir_overwrite_lets_a_server_replace_the_records(tmp_path):
    from fedcore.deployment.distributed import ServerCourse
    from fedcore.kernel.errors import ConfigError
    from tests.conftest import small_cfg
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n')
    keys = dict(federate__mode="distributed", distribute__role="server", distribute__insecure=True)
    with pytest.raises(ConfigError, match="holds another run's records"):
        ServerCourse(small_cfg(tmp_path, **keys), tmp_path).write_header()
    ServerCourse(small_cfg(tmp_path, outdir_overwrite=True, **keys), tmp_path).write_header()
    assert (tmp_path / "config.yaml").is_file()


def test_the_restart_rule_and_backoff_are_the_documented_ones():
    from fedcore.launch import abnormal, restart_delay
    assert [abnormal(rc) for rc in (-signal.SIGKILL, -signal.SIGSEGV, 1, 4)] == [True] * 4
    assert [abnormal(rc) for rc in (0, 2, 3, 5, 6, 130)] == [False] * 6   # outcomes, not crashes
    assert [restart_delay(k) for k in range(7)] == [1, 2, 4, 8, 16, 30, 30]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.slow
def test_a_client_sigkilled_under_restart_comes_back_with_its_state_and_the_course_finishes(procs, tmp_path):
    """`--restart 1`: client 1 is SIGKILLed once its update of round 2 has left it (client 2 is
    held before round 2 until client 1 is back, so the course cannot end without it); the
    launcher starts it again with the same arguments, it loads its state of round 2, and the
    course finishes with every client in every round."""
    marks = tmp_path / "marks"
    marks.mkdir()
    cfg = write_cfg(tmp_path / "course.yaml", {
        "plugins": ["tests.client_kill_plugin"], "algorithm.name": "scaffold_held",
        "federate.client_num": 3, "federate.total_round_num": 3, "eval.clients": False,
        "kill_test.folder": str(marks), "kill_test.hold_clients": [2], "kill_test.hold_round": 2,
        "kill_test.mark_clients": [1], "kill_test.mark_round": 2, "distribute.round_deadline": 300.0,
        "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 1.5,
        "distribute.backoff_initial": 0.1, "distribute.backoff_max": 0.5})
    out = tmp_path / "out"
    launcher = procs.start("launch", ["-m", "fedcore.launch", "--restart", "1", "--cfg", str(cfg),
                                      f"outdir={out}"])
    sent = marks / "sent_1_2"

    def sent_pid():
        assert launcher.poll() is None, text(launcher)[-3000:]
        return sent.exists() and sent.read_text()   # written at once: the pid, or nothing yet
    first = int(wait_for(sent_pid, 240, "client 1's update of round 2"))
    time.sleep(1.0)                                  # on its way over loopback
    before = set(launched(launcher.pid))
    assert first in before and len(before) == 4      # the server and three clients
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: "client 1: loaded its state of round 2" in text(launcher), 120,
             "client 1 restarted with its state")
    after = set(launched(launcher.pid))
    assert first not in after and len(after - before) == 1   # one new process: client 1 again
    time.sleep(1.0)                                  # its join on its way
    (marks / "go").write_text("")
    assert wait_exit(launcher, 240) == 0, text(launcher)[-3000:]
    log = text(launcher)
    assert "fedcore.launch: client 1 died (killed by SIGKILL); restart 1 of 1 in 1s" in log
    assert "client 1: course finished (last round 3)" in log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["num_updates"]) for r in records] == [(1, 3), (2, 3), (3, 3)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.slow
def test_a_server_sigkilled_under_restart_is_started_again_on_its_port_to_resume(procs, tmp_path):
    """The launcher's half of a server restart: the same port, and `resume_from=latest` (what
    the server does with it is the server's own, tested with it)."""
    cfg = write_cfg(tmp_path / "course.yaml", {
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.3,
        "federate.client_num": 2, "federate.total_round_num": 10000, "eval.clients": False})
    out = tmp_path / "out"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *SPAWN, "--restart", "1", "--cfg", str(cfg),
                                      f"outdir={out}"])
    address = out / "server_address"
    port = wait_for(lambda: address.exists() and address.read_text().strip().rsplit(":", 1)[1], 120,
                    "the server to listen")

    def servers():
        return [p for p in _children(launcher.pid) if "distribute.role=server" in _cmdline(p)]
    (first,) = wait_for(servers, 30, "the server process")
    os.kill(first, signal.SIGKILL)
    again = wait_for(lambda: [p for p in servers() if p != first], 30, "the server started again")
    cmdline = _cmdline(again[0]).split()
    assert "resume_from=latest" in cmdline and f"distribute.server_port={port}" in cmdline
    assert "distribute.server_port=0" not in cmdline
    # each launched client has a process and a connection of its own, which needs at most 3 calls
    assert "distribute.max_streams_per_connection=4" in cmdline
    wait_for(lambda: "fedcore.launch: the server died (killed by SIGKILL); restart 1 of 1 in 1s" in text(launcher),
             10, "the launcher to say so")


@pytest.mark.slow
def test_a_stopped_launch_prints_the_launch_that_resumes_it_and_that_launch_finishes(procs, tmp_path):
    """The launched server's resume line is a launch (its tokens and port die with the launcher),
    and the launcher gives resume_from to the server alone (a client resumes through it)."""
    import re
    import shlex
    cfg = write_cfg(tmp_path / "course.yaml", {
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.2,
        "federate.client_num": 2, "federate.total_round_num": 8, "eval.clients": False})
    out = tmp_path / "out"
    launcher = procs.start("launch", ["-m", "fedcore.launch", "--cfg", str(cfg), f"outdir={out}"])
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 240, "two rounds")
    launcher.send_signal(signal.SIGTERM)   # as Ctrl-C: an orderly stop
    assert wait_exit(launcher, 60) == 130, text(launcher)[-3000:]
    line = re.search(r"resume from the snapshot of round (\d+) with: cd (\S+) && (.*)", text(launcher))
    assert line, text(launcher)[-3000:]
    command = shlex.split(line.group(3))
    assert command[1:3] == ["-m", "fedcore.launch"] and any(a.startswith("resume_from=") for a in command)
    assert Path(line.group(2)) == ROOT   # where the launcher ran: the paths in the command hold there
    resumed = procs.start("resumed", command[1:])
    assert wait_exit(resumed, 240) == 0, text(resumed)[-3000:]
    rounds = [json.loads(r)["round"] for r in metrics.read_text().splitlines()]
    assert rounds == list(range(1, 9))   # every round once: none lost, none repeated


@pytest.mark.slow
def test_ctrl_c_of_a_launch_prints_one_interrupted_line(procs, tmp_path):
    """Ctrl-C reaches the launcher and, from it, every process it started: the launch says
    `interrupted` once, not once per process, and keeps the server's resume line."""
    cfg = write_cfg(tmp_path / "course.yaml", {
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.2,
        "federate.client_num": 3, "federate.total_round_num": 10000, "eval.clients": False})
    out = tmp_path / "out"
    launcher = procs.start("launch", ["-m", "fedcore.launch", "--cfg", str(cfg), f"outdir={out}"])
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 240, "two rounds")
    launcher.send_signal(signal.SIGINT)
    assert wait_exit(launcher, 60) == 130, text(launcher)[-3000:]
    log = text(launcher)
    assert log.count("interrupted") == 1 and log.rstrip().endswith("fedcore: interrupted"), log[-3000:]
    assert "resume from the snapshot of round" in log


def test_a_launch_whose_clients_all_end_for_good_stops_its_server(procs, tmp_path):
    """Clients refused for a configuration the server does not share end with status 2, never
    restarted: the launcher stops its server instead of letting it wait for them for ever."""
    cfg = write_cfg(tmp_path / "course.yaml", {"federate.client_num": 2, "federate.total_round_num": 3})
    launcher = procs.start("launch", ["-m", "fedcore.launch", "--cfg", str(cfg), "--client-opt",
                                      "model.type=mlp", f"outdir={tmp_path / 'out'}"])
    assert wait_exit(launcher, 120) == 2, text(launcher)[-3000:]
    log = text(launcher)
    assert log.count("refused this client: course config differs from the server's: model.type") == 2
    assert "fedcore.launch: every client ended (exit status 2); stopping the server" in log
