"""`fedcore.launch` with real processes: a server it restarts keeps its clients, and a server
that refuses at its start ends the launch at once, with its status and its line."""
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.deploy_helpers import launched, listening, text, wait_exit, wait_for, write_cfg


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.slow
def test_a_server_sigkilled_under_restart_keeps_its_clients_and_the_course_completes(procs, tmp_path):
    """The clients give up on a server gone for 3 s (distribute.retry_timeout), less than the
    restart takes (1 s of delay, then the resumed server holds 4 s before it listens:
    slow_test.resume_delay): they wait for the server their launcher restarts instead, the same
    processes, and the resumed course runs every round once."""
    cfg = write_cfg(tmp_path / "course.yaml", {
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.3,
        "slow_test.resume_delay": 4.0,
        "federate.client_num": 2, "federate.total_round_num": 6, "eval.clients": False,
        "distribute.retry_timeout": 3.0, "distribute.backoff_initial": 0.1, "distribute.backoff_max": 0.5})
    out = tmp_path / "out"
    launcher = procs.start("launch", ["-m", "fedcore.launch", "--restart", "1", "--cfg", str(cfg),
                                      f"outdir={out}"])
    metrics, address = out / "metrics.jsonl", out / "server_address"

    def two_rounds():
        assert launcher.poll() is None, text(launcher)[-3000:]
        return metrics.exists() and metrics.read_text().count("\n") >= 2
    wait_for(two_rounds, 240, "two rounds")
    port = int(address.read_text().strip().rsplit(":", 1)[1])
    courses = launched(launcher.pid)
    (server,) = listening(courses, port)
    clients = sorted(set(courses) - {server})
    assert len(clients) == 2
    os.kill(server, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: not address.exists(), 30, "the launcher to see its server dead")
    wait_for(address.exists, 60, "the restarted server to listen")
    assert time.monotonic() - killed > 3.0   # longer than the clients' retry_timeout
    assert wait_exit(launcher, 240) == 0, text(launcher)[-3000:]
    log = text(launcher)
    assert "fedcore.launch: the server died (killed by SIGKILL); restart 1 of 1 in 1s" in log
    assert "the launcher is restarting the server; waiting for it" in log
    assert "died" not in log.replace("the server died", ""), log[-3000:]   # no client ended, none restarted
    assert "giving up" not in log
    for k in (1, 2):
        assert f"client {k}: course finished (last round 6)" in log
    rounds = [json.loads(r)["round"] for r in metrics.read_text().splitlines()]
    assert rounds == list(range(1, 7))


def test_a_client_without_the_launchers_notice_keeps_its_plain_budget(tmp_path, monkeypatch):
    """The notice is the launcher's file, named in the environment: absent (a client started by
    hand, or the launcher's restart over), a client counts every second without its server."""
    from fedcore.comm.restart_notice import RESTARTING_ENV, RestartNotice, server_restarting
    notice = RestartNotice(tmp_path)
    monkeypatch.delenv(RESTARTING_ENV, raising=False)
    notice.begin()
    assert not server_restarting()                 # no variable: not this launch's client
    monkeypatch.setenv(RESTARTING_ENV, notice.env[RESTARTING_ENV])
    assert server_restarting()
    notice.end()
    assert not server_restarting() and not notice.path.exists()


def test_a_launch_that_spawns_more_interpreters_than_the_cores_hold_says_so_with_the_figures():
    from fedcore.deployment.launch_capacity import IMPORT_CPU_S, IMPORT_MB, PER_CORE, crowding
    # 31 interpreters (a server, 30 clients) on 2 cores: 31 x 3 s of CPU over 2 cores
    line = crowding(31, spawned=True, forkserver_available=True, n_cores=2, memory_mb=64000)
    assert line == (f"fedcore.launch: starting 31 interpreters on 2 cores: each imports torch (~{IMPORT_CPU_S} s "
                    f"of CPU, ~{IMPORT_MB} MB), ~{round(31 * IMPORT_CPU_S / 2)} s before the first round; "
                    "--start-method forkserver shares one import")
    assert crowding(2 * PER_CORE, True, True, 2, 64000) is None          # a few per core: silent
    assert crowding(2 * PER_CORE + 1, True, True, 2, 64000) is not None
    assert crowding(31, spawned=False, forkserver_available=True, n_cores=2, memory_mb=64000) is None
    # memory first: 10 x 300 MB where 2000 MB are available
    assert crowding(10, True, False, 16, 2000) == (
        f"fedcore.launch: starting 10 interpreters of ~{IMPORT_MB} MB each (~{10 * IMPORT_MB} MB) with 2000 MB "
        "available; fewer clients per launch")


@pytest.mark.slow
@pytest.mark.parametrize("refusal", ["records", "tls", "address"])
def test_a_launch_whose_server_refuses_at_start_ends_at_once_with_its_status_and_line(procs, tmp_path, refusal):
    """A config error only the server meets (an outdir holding another run's records), a TLS
    file that is no certificate, an address it cannot listen on: the server exits 2 with its
    line, and the launch ends with it, no client ever started."""
    cfg = write_cfg(tmp_path / "course.yaml")
    out = tmp_path / "out"
    extra: list[str] = []
    if refusal == "records":
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"round": 1}\n')
        line = f"fedcore: outdir: '{out}' holds another run's records (metrics.jsonl)"
    elif refusal == "tls":
        junk = tmp_path / "junk.pem"
        junk.write_text("not a certificate\n")
        extra = ["--server-opt", f"distribute.tls.cert={junk}", "--server-opt", f"distribute.tls.key={junk}"]
        line = f"fedcore: distribute.tls.key: '{junk}' and distribute.tls.cert '{junk}' are not a PEM certificate"
    else:
        extra = ["--server-opt", "distribute.server_host=192.0.2.1"]   # TEST-NET-1: no machine's own
        line = "fedcore: distribute.server_port: cannot listen on 192.0.2.1:0"
    launcher = procs.start("launch", ["-m", "fedcore.launch", "--restart", "2", "--cfg", str(cfg), *extra,
                                      f"outdir={out}"])
    assert wait_exit(launcher, 120) == 2, text(launcher)[-3000:]
    log = text(launcher)
    assert line in log, log[-3000:]
    assert "client 1" not in log and "restart 1 of" not in log   # none started; a refusal is not restarted


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
@pytest.mark.slow
def test_a_restarted_server_whose_port_is_taken_ends_the_launch_with_its_line(procs, tmp_path):
    """`--restart`: the server is started again on its port; another process took that port
    meanwhile, so the new server cannot listen: it says so (exit 2) and the launch ends with it
    rather than leaving its clients waiting. The launcher is stopped (SIGSTOP) while the port
    changes hands, so its restart cannot come first however slow the machine."""
    import socket
    cfg = write_cfg(tmp_path / "course.yaml", {
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.3,
        "federate.client_num": 2, "federate.total_round_num": 10000, "eval.clients": False})
    out = tmp_path / "out"
    launcher = procs.start("launch", ["-m", "fedcore.launch", "--restart", "1", "--cfg", str(cfg),
                                      f"outdir={out}"])
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 240, "a round")
    port = int((out / "server_address").read_text().strip().rsplit(":", 1)[1])
    (server,) = listening(launched(launcher.pid), port)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # past the old connections' TIME_WAIT

    def taken() -> bool:
        try:
            squatter.bind(("127.0.0.1", port))
            return True
        except OSError:   # the killed server's socket not closed yet
            return False
    launcher.send_signal(signal.SIGSTOP)
    try:
        os.kill(server, signal.SIGKILL)
        wait_for(taken, 60, "the port free")
        squatter.listen()
    finally:
        launcher.send_signal(signal.SIGCONT)   # it finds its server dead, restarts it after 1 s
    try:
        assert wait_exit(launcher, 240) == 2, text(launcher)[-3000:]
    finally:
        squatter.close()
    log = text(launcher)
    assert f"fedcore: distribute.server_port: cannot listen on 127.0.0.1:{port} (already in use" in log
