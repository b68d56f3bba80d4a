"""A deployed server SIGKILLed at chosen moments and restarted with resume_from=latest.

Real processes on loopback. The clients are never restarted: they reconnect through their
retry loop, are welcomed by the new incarnation and join again. The uninterrupted course
is the simulation of the same config (a deployed course equals its simulation to 1e-6,
tests/test_deploy_course.py). The moments are test pauses of the server (fedcore.runtime.snapshot's
around the snapshot write, tests.slow_plugin's in the aggregation and between the first
client's models and the others'), except while updates arrive: then clients 1 and 2 reply
at once and client 3 takes 5 s to train that round (tests.slow_plugin).
"""
import json
import logging
import signal
import socket
import time

import pytest
import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from tests.deploy_helpers import text, wait_exit, wait_for, write_cfg

pytestmark = pytest.mark.slow

ROUNDS = 4
KILLED_IN = 3        # the round in flight (or being snapshotted) when the server dies

COURSE = {
    "federate.total_round_num": ROUNDS, "eval.clients": False,
    "distribute.insecure": True, "distribute.token": "t", "distribute.round_deadline": 60.0,
    "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 20.0,
    "distribute.retry_timeout": 300.0, "distribute.backoff_initial": 0.1, "distribute.backoff_max": 0.5,
}
PAUSE = "FEDCORE_TEST_PAUSE_IN_SNAPSHOT"   # fedcore.runtime.snapshot's test hook
SERVER_PAUSE = "FEDCORE_TEST_PAUSE_SERVER"  # tests.slow_plugin's
UPDATE_LOG = "FEDCORE_TEST_UPDATE_LOG"      # tests.slow_plugin's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(out):
    f = out / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def _simulated(cfg_path, out, *overrides):
    """The uninterrupted course: the same config, simulated in this process."""
    cfg = load_config([str(cfg_path)], ["federate.mode=standalone", f"outdir={out}", *overrides])
    Course(cfg).run()
    return torch.load(out / "final_model.pt", weights_only=True)


def _pause_env(moment, r) -> dict:
    """The environment of a server that is to pause at `moment` of round `r` (see _catch)."""
    return {"before-broadcast": {PAUSE: f"{r - 1}:60:after"}, "snapshot-write": {PAUSE: f"{r}:60"},
            "aggregation": {SERVER_PAUSE: f"aggregation:{r}:60"},
            "broadcast": {SERVER_PAUSE: f"broadcast:{r}:60"}}.get(moment, {})


def _catch(moment, r, server, out, tmp_path) -> None:
    """Wait until `server` is at `moment` of round `r` and check what is on disk then:
    before-broadcast: the snapshot of round r - 1 complete, round r's models not yet sent
      (no client has trained a round the snapshot does not hold);
    broadcast: round r's models sent to client 1 only, which trained the round and kept its
      state of it; clients 2 and 3 have not received them;
    updates-arriving: clients 1 and 2 trained round r and replied, client 3 is training;
    aggregation: every update of round r in, its aggregation begun, nothing of it on disk;
    snapshot-write: inside the aggregation of round r, its record written to metrics.jsonl,
      its snapshot's temp file written and not yet renamed."""
    state = [tmp_path / f"client{k}" / "client_state" / str(k) / f"round_{r}.state" for k in (1, 2, 3)]
    if moment != "updates-arriving":
        wait_for(lambda: "test pause" in text(server), 300, f"the server's pause in round {r}")
    trained = {"broadcast": 1, "updates-arriving": 2}.get(moment)   # the clients that trained round r
    if trained:
        wait_for(lambda: all(s.exists() for s in state[:trained]), 300, f"round {r} trained by {trained}")
        time.sleep(0.3)   # their updates reach the server (a client keeps its state, then replies)
        assert not any(s.exists() for s in state[trained:])
    if moment == "snapshot-write":
        assert (out / "checkpoints" / f"round_{r}.tmp").exists()
        assert len(_lines(out)) == r   # the round's record is out, its snapshot is not
    else:   # nothing of round r on the server's disk
        assert not list((out / "checkpoints").glob(f"round_{r}.*"))
        assert len(_lines(out)) == r - 1


def _kill_and_resume(procs, tmp_path, extra, kills, rounds=ROUNDS):
    """Run the course, SIGKILL its server at each of `kills` ({round: moment}, see _catch)
    and start it again with resume_from=latest each time; returns the outdir."""
    keys = {k: () for k in (1, 2, 3)}
    if extra.get("secure_aggregation.enabled"):   # the operator's roster of signing keys
        from fedcore.algorithms.secagg_identity import write_roster
        roster, key_files = write_roster(tmp_path, [1, 2, 3])
        extra = {**extra, "secure_aggregation.roster": str(roster)}
        keys = {k: (f"secure_aggregation.signing_key={key_files[k]}",) for k in (1, 2, 3)}
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, "federate.total_round_num": rounds, **extra})
    out, port = tmp_path / "out", _free_port()
    common = ("distribute.role=server", f"distribute.server_port={port}", f"outdir={out}")
    first = min(kills)
    server = procs.fedcore("server", cfg, *common, env=_pause_env(kills[first], first))
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                             f"distribute.client_id={k}", f"outdir={tmp_path / f'client{k}'}", *keys[k])
               for k in (1, 2, 3)]   # each keeps its state on disk, to go back to the resumed round
    for n, r in enumerate(sorted(kills), 1):
        _catch(kills[r], r, server, out, tmp_path)
        server.send_signal(signal.SIGKILL)
        server.wait(30)
        server = procs.fedcore(f"server-resumed-{n}", cfg, *common, "resume_from=latest",
                               env=_pause_env(kills.get(r + 1), r + 1))
        wait_for(lambda: f"resuming the course from the snapshot of round {r - 1}" in text(server), 120,
                 f"the server to resume from round {r - 1}")
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    for c in clients:
        assert wait_exit(c, 60) == 0, text(c)[-2000:]
    records = _lines(out)
    assert [r["round"] for r in records] == list(range(1, rounds + 1))   # each round once, in order
    assert all(r["num_updates"] == 3 for r in records)
    for field in ("virtual_time", "wall_time"):   # the clocks go on from each snapshot's
        times = [r[field] for r in records]
        assert times == sorted(times), (field, times)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == rounds and summary["resumed_from"]["round"] == max(kills) - 1
    assert summary["wall_time"] >= records[-1]["wall_time"]
    return out


def _assert_same(final, simulated):
    assert final.keys() == simulated.keys()
    for name in simulated:
        assert torch.allclose(final[name], simulated[name], rtol=0, atol=1e-6), name


SECURE = {"secure_aggregation.enabled": True, "model.dtype": "float64"}


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", pytest.param(
    "fedavg-secure-aggregation", marks=pytest.mark.extra("secagg"))])
def test_server_killed_between_snapshot_and_broadcast_ends_as_the_uninterrupted_course(
        tmp_path, procs, algorithm):
    # SCAFFOLD's client control variates live in the clients, which go on running; a secure
    # aggregation course runs its interrupted round's protocol again from its start
    extra = {**SECURE, "algorithm.name": "fedavg"} if algorithm.endswith("secure-aggregation") \
        else {"algorithm.name": algorithm}
    out = _kill_and_resume(procs, tmp_path, extra, {KILLED_IN: "before-broadcast"})
    simulated = _simulated(tmp_path / "course.yaml", tmp_path / "simulated")
    _assert_same(torch.load(out / "final_model.pt", weights_only=True), simulated)
    if algorithm.endswith("secure-aggregation"):   # its typed state went on from the snapshot's:
        last = torch.load(out / "checkpoints" / f"round_{ROUNDS}.pt", weights_only=True)
        assert last["states"]["secure_aggregation"]["aggregated"] == ROUNDS   # every round, both runs
    if algorithm == "fedavg":   # the deployed snapshot of round 3 resumes in simulation too
        _resume_in_simulation(tmp_path, out / "checkpoints" / f"round_{ROUNDS - 1}.pt")


def _resume_in_simulation(tmp_path, snapshot):
    """Same format: a deployed snapshot resumes in simulation, from the same global model and
    records (its clients start afresh: the server's snapshot holds no client state)."""
    sim = tmp_path / "resumed-in-simulation"
    cfg = load_config([str(tmp_path / "course.yaml")],
                      ["federate.mode=standalone", f"outdir={sim}", f"resume_from={snapshot}"])
    Course(cfg).run()
    assert [r["round"] for r in _lines(sim)] == list(range(1, ROUNDS + 1))
    assert _lines(sim)[:ROUNDS - 1] == _lines(snapshot.parent.parent)[:ROUNDS - 1]


def test_a_simulated_snapshot_resumes_on_a_deployed_server(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", COURSE)
    sim = tmp_path / "simulated"
    Course(load_config([str(cfg)], ["federate.mode=standalone", f"outdir={sim}", "checkpoint.every=1"])).run()
    out, port = tmp_path / "out", _free_port()
    server = procs.fedcore("server", cfg, "distribute.role=server", f"distribute.server_port={port}",
                           f"outdir={out}", f"resume_from={sim / 'checkpoints' / 'round_2.pt'}")
    for k in (1, 2, 3):
        procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                      f"distribute.client_id={k}")
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    records = _lines(out)
    assert records[:2] == _lines(sim)[:2]   # the simulation's records, then the deployed rounds
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))


# one course, its server killed at each moment of a round in turn, each in its own round
KILLS = {2: "broadcast", 3: "updates-arriving", 4: "aggregation", 5: "snapshot-write"}


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_server_killed_at_each_moment_of_a_round_runs_that_round_again_once(tmp_path, procs, algorithm):
    # Each round in flight is run again from the snapshot before it; metrics.jsonl keeps only
    # the records that snapshot holds (a killed run's record of its round is dropped). The
    # clients that had trained the round (client 1 while broadcasting, 1 and 2 while updates
    # arrive, all three in the aggregation and the snapshot write) each go back to their state
    # of the snapshot's round (SCAFFOLD's c_i), so the course ends as if uninterrupted.
    out = _kill_and_resume(procs, tmp_path, {
        "plugins": ["tests.slow_plugin"], "algorithm.name": f"{algorithm}_pausing", "slow_test.pause": 0.0,
        "slow_test.stall_clients": [3], "slow_test.stall": 5.0, "slow_test.stall_once_in_round": 3},
        KILLS, rounds=max(KILLS))
    # simulated, the stalling client stalls for no time: how long it takes changes nothing it computes
    simulated = _simulated(tmp_path / "course.yaml", tmp_path / "simulated", "slow_test.stall=0.0")
    _assert_same(torch.load(out / "final_model.pt", weights_only=True), simulated)


# ---------------------------------------------------------------- records that never stall

def _running(out) -> bool:
    """The server has not finalized its outputs (summary.json comes last)."""
    return not (out / "summary.json").exists()


def _eval_course(procs, tmp_path, extra):
    from tests.deploy_helpers import serve_course
    cfg = write_cfg(tmp_path / "course.yaml", {
        **COURSE, "eval.clients": True, "distribute.heartbeat_timeout": 2.0,
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", **extra})
    out = tmp_path / "out"
    server, _port, client = serve_course(procs, cfg, out)
    return out, server, {k: client(k) for k in (1, 2, 3)}


def test_a_client_killed_mid_course_holds_back_no_record(tmp_path, procs):
    # Client 3 is SIGKILLed after round 1; its evaluations are never answered. The record of
    # each round is written by the end of the next at the latest, while the server runs.
    rounds = 6
    out, server, clients = _eval_course(procs, tmp_path, {"federate.total_round_num": rounds,
                                                          "slow_test.pause": 0.3})
    wait_for(lambda: _lines(out), 120, "round 1's record")
    clients[3].kill()
    grew = wait_for(lambda: _running(out) and len(_lines(out)) >= rounds - 1 and _lines(out),
                    120, "a record per finished round while the course runs")
    assert [r["round"] for r in grew[:rounds - 1]] == list(range(1, rounds))
    assert wait_exit(server, 120) == 0, text(server)[-3000:]
    records = [r for r in _lines(out) if "round" in r]
    assert [r["round"] for r in records] == list(range(1, rounds + 1))
    assert records[-1]["num_updates"] == 2 and records[-1]["client_evals"] == 2


def test_a_hung_trainer_holds_back_no_record_and_is_named_dropped(tmp_path, procs):
    # Client 3 trains round 1, then its trainer hangs evaluating round 1's model (its
    # heartbeats go on): that evaluation is never answered. Each round's record is out by
    # the end of the next round, before the server's end, and the summary names it dropped.
    rounds = 4
    out, server, clients = _eval_course(procs, tmp_path, {
        "federate.total_round_num": rounds, "slow_test.hang_eval_clients": [3],
        "distribute.round_deadline": None, "distribute.max_round_deadline": 2.0})
    wait_for(lambda: _running(out) and len(_lines(out)) >= rounds - 1, 120,
             "the records of rounds 1-3 while the course runs")
    assert wait_exit(server, 120) == 0, text(server)[-3000:]
    assert [r["round"] for r in _lines(out)] == list(range(1, rounds + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert any(3 in d["clients"] for d in summary["dropped"])
    for k in (1, 2):
        assert wait_exit(clients[k], 60) == 0


def test_a_late_evaluation_is_its_own_line_and_no_round_is_written_twice(tmp_path):
    from fedcore.runtime.monitor import Monitor
    m = Monitor(tmp_path)
    m.hold_one_round = True
    m.record_round(1, 1.0, {"test_acc": 0.5}, expected_client_metrics=2)
    m.add_client_metrics(1, 1, {"acc": 0.25, "loss": 1.0})
    assert _lines(tmp_path) == []                       # round 1 waits for client 2 ...
    m.record_round(2, 2.0, {"test_acc": 0.75}, expected_client_metrics=0)
    lines = _lines(tmp_path)                            # ... until round 2 ends
    assert [r["round"] for r in lines] == [1, 2] and lines[0]["client_evals"] == 1
    m.add_client_metrics(1, 2, {"acc": 0.75, "loss": 0.5})
    late = _lines(tmp_path)[2]
    assert "round" not in late and late["late_eval"] == {"round": 1, "client": 2, "acc": 0.75, "loss": 0.5}
    assert m.lines_written == 3 and [r["round"] for r in m.records] == [1, 2]
    # the round and the client of a late line are the server's: a metric of those names (which
    # the wire refuses anyway) cannot credit another client or round
    m.add_client_metrics(1, 2, {"acc": 0.999, "client": 1, "round": 5})
    assert _lines(tmp_path)[3]["late_eval"] == {"acc": 0.999, "client": 2, "round": 1}
    from fedcore.comm.validation import check_metrics
    assert check_metrics({"acc": 0.5, "client": 1}, None) == "metric name 'client' is reserved for the server's record"
    assert check_metrics({"acc": 0.5, "loss": 1.0}, None) is None


def test_a_record_waits_its_hold_after_the_next_round_and_is_closed_by_the_watch(tmp_path):
    # Rounds may end faster than evaluations come back: a record whose next round has ended
    # still waits hold_seconds from its opening; the periodic close_overdue writes it then.
    from fedcore.runtime.monitor import Monitor
    m = Monitor(tmp_path)
    m.hold_one_round = True
    hold = [3600.0]
    m.hold_seconds = lambda: hold[0]
    m.record_round(1, 1.0, {"test_acc": 0.5}, expected_client_metrics=2)
    m.record_round(2, 2.0, {"test_acc": 0.6}, expected_client_metrics=0)
    m.close_overdue()
    assert _lines(tmp_path) == []                       # round 1 within its hold; round 2 behind it
    m.add_client_metrics(1, 1, {"acc": 0.25, "loss": 1.0})
    m.add_client_metrics(1, 2, {"acc": 0.75, "loss": 0.5})
    lines = _lines(tmp_path)                            # complete in time: both written, in order
    assert [r["round"] for r in lines] == [1, 2] and lines[0]["client_evals"] == 2
    m.record_round(3, 3.0, {"test_acc": 0.7}, expected_client_metrics=1)
    m.record_round(4, 4.0, {"test_acc": 0.8}, expected_client_metrics=0)
    assert len(_lines(tmp_path)) == 2
    hold[0] = 0.0                                       # the hold has passed
    m.close_overdue()
    lines = _lines(tmp_path)
    assert [r["round"] for r in lines] == [1, 2, 3, 4] and "client_evals" not in lines[2]


def test_a_finished_server_awaits_a_departure_its_event_loop_saw_until_it_handles_it():
    # Both clients answered the last evaluation and said bye. The event loop has seen the byes
    # (no live session), but the scheduler thread has not yet run the queued metrics and
    # departures: the server must not stop then (it did, and wrote the last record without
    # its evaluations); it stops once it has handled both departures.
    from types import SimpleNamespace
    from fedcore.deployment.distributed import ServerCourse
    stops, triggered = [], []
    course = ServerCourse.__new__(ServerCourse)
    course.cfg = {"distribute.heartbeat_timeout": 2.0}
    course.scheduler = SimpleNamespace(clock=10.0, now=10.0, stop=lambda: stops.append(course.scheduler.clock))
    course.server = SimpleNamespace(finished=True, joined={1, 2, 3}, now=0.0,
                                    trigger=lambda event, data=None: triggered.append((event, data)))
    course.comm = SimpleNamespace(live_ids=lambda joined=None: [])
    course.monitor = SimpleNamespace(open_records=lambda: {6: {}}, hold_seconds=lambda: 60.0)
    course._finish_clock, course._awaiting, course._departed = None, None, {3}   # 3 was lost before
    course._maybe_stop()
    assert stops == [] and course._awaiting == {1, 2}
    course._lost(1, "left: finished")
    assert stops == []
    course._lost(2, "left: finished")
    assert stops == [10.0] and [e for e, _ in triggered] == ["client_lost", "client_lost"]


def _server_and_clients(procs, cfg, out):
    """A server on a free port writing to `out`, and clients 1, 2, 3 dialling it."""
    port = _free_port()
    server = procs.fedcore("server", cfg, "distribute.role=server", f"distribute.server_port={port}",
                           f"outdir={out}")
    return server, [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                                  f"distribute.client_id={k}") for k in (1, 2, 3)]


def _resume_and_finish(procs, command: str, clients, out, rounds: int) -> None:
    """Run the resume command an interrupted server printed, as a user pastes it into a shell:
    the course finishes, every client with it, each round recorded once."""
    resumed = procs.start("server-resumed", ["-c", "import os, sys; os.execvp('bash', ['bash', '-c', sys.argv[1]])",
                                             command])
    assert wait_exit(resumed, 240) == 0, text(resumed)[-3000:]
    for c in clients:
        assert wait_exit(c, 60) == 0, text(c)[-2000:]
    assert [r["round"] for r in _lines(out)] == list(range(1, rounds + 1))


def test_sigterm_snapshots_the_last_round_and_the_printed_command_resumes_the_course(tmp_path, procs):
    # checkpoint.every=0: no snapshot until the server is told to stop
    rounds = 6
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, "federate.total_round_num": rounds,
                                               "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing",
                                               "slow_test.pause": 0.3, "checkpoint.every": 0})
    out = tmp_path / "out"
    server, clients = _server_and_clients(procs, cfg, out)
    wait_for(lambda: len(_lines(out)) >= 2, 120, "two rounds")
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("*.pt"))
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, 60) == 130
    said = text(server).strip().splitlines()
    reached = int(next(x for x in said if "stopped after round" in x).split("stopped after round ")[1].split(";")[0])
    assert f"outputs in {out.resolve()}" in "\n".join(said)
    command = next(x for x in said if "resume from the snapshot of round" in x).split(" with: ", 1)[1]
    assert f"resume from the snapshot of round {reached} with" in "\n".join(said)
    assert (out / "checkpoints" / f"round_{reached}.pt").is_file()
    _resume_and_finish(procs, command, clients, out, rounds)


def test_sigterm_as_a_round_is_recorded_snapshots_that_round(tmp_path, procs):
    # SIGTERM while round 2's record is written (tests.sigterm_at_record_plugin), before the
    # state of round 2 is kept for a snapshot: the interrupt waits for both, so the server
    # stops after round 2 with the snapshot of round 2, and the printed command finishes it
    rounds = 4
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, "federate.total_round_num": rounds,
                                               "plugins": ["tests.sigterm_at_record_plugin"],
                                               "sigterm_test.round": 2, "checkpoint.every": 0})
    out = tmp_path / "out"
    server, clients = _server_and_clients(procs, cfg, out)
    assert wait_exit(server, 120) == 130, text(server)[-3000:]
    said = text(server)
    assert "fedcore: stopped after round 2;" in said and "resume from the snapshot of round 2 with" in said, said[-3000:]
    command = next(x for x in said.splitlines() if "resume from the snapshot of round" in x).split(" with: ", 1)[1]
    _resume_and_finish(procs, command, clients, out, rounds)


def test_fedbuff_server_killed_resumes_and_finishes_counting_no_update_twice(tmp_path, procs):
    # FedBuff aggregates every 2 updates. The server is killed once it has snapshotted round 2;
    # the resumed one counts only updates from clients that joined it. Every update is
    # followed by a digest of its content (tests.slow_plugin's update log): from the client
    # that sent it into the rounds that aggregated it, the killed server's up to its snapshot
    # and the resumed server's after it, which together made the final model.
    rounds = 40
    cfg = write_cfg(tmp_path / "course.yaml", {
        **COURSE, "federate.total_round_num": rounds, "algorithm.name": "fedbuff", "asyn.use": True,
        "asyn.aggregator": "goal_achieved", "asyn.min_received_num": 2,
        "asyn.broadcast_manner": "after_receiving", "plugins": ["tests.slow_plugin"]})
    out, port = tmp_path / "out", _free_port()
    common = ("distribute.role=server", f"distribute.server_port={port}", f"outdir={out}")
    logs = {name: tmp_path / f"updates-{name}.jsonl" for name in ("killed", "resumed", 1, 2, 3)}
    server = procs.fedcore("server", cfg, *common, env={UPDATE_LOG: str(logs["killed"])})
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                             f"distribute.client_id={k}", env={UPDATE_LOG: str(logs[k])}) for k in (1, 2, 3)]
    wait_for((out / "checkpoints" / "round_2.pt").exists, 120, "the snapshot of round 2", interval=0.01)
    server.send_signal(signal.SIGKILL)
    server.wait(30)
    resumed = procs.fedcore("server-resumed", cfg, *common, "resume_from=latest",
                            env={UPDATE_LOG: str(logs["resumed"])})
    assert wait_exit(resumed, 240) == 0, text(resumed)[-3000:]
    resumed_from = json.loads((out / "summary.json").read_text())["resumed_from"]["round"]
    assert 2 <= resumed_from < rounds
    records = _lines(out)
    assert [r["round"] for r in records] == list(range(1, rounds + 1))
    assert all(r["num_updates"] == 2 for r in records)
    for c in clients:
        assert wait_exit(c, 60) == 0, text(c)[-2000:]
    read = {name: [json.loads(x) for x in f.read_text().splitlines()] for name, f in logs.items()}
    assert all(e["round"] > resumed_from for e in read["resumed"])
    counted = [e for e in read["killed"] if e["round"] <= resumed_from] + read["resumed"]
    assert sorted(e["round"] for e in counted) == sorted(2 * list(range(1, rounds + 1)))
    digests = [e["digest"] for e in counted]
    assert len(set(digests)) == len(digests)   # no update counted twice
    for e in counted:   # each one an update its client sent
        assert e["digest"] in {s["digest"] for s in read[e["client"]]}, e


# ---------------------------------------------------------------- the server's half of state_round

def _joining(round_, started, contributed):
    from types import SimpleNamespace
    from fedcore.runtime.monitor import Monitor
    course = SimpleNamespace(checkpointer=SimpleNamespace(contributed=contributed), monitor=Monitor(None))
    return SimpleNamespace(course=course, round=round_, started=started)


@pytest.mark.parametrize("state_round, mismatch", [
    (2, False),    # E = 2: its state is of its last aggregated update
    (1, True),     # older than its update of round 2, which the server aggregated
    (3, False),    # round 3's update trained but not aggregated (E < S <= U = 3)
    (4, True),     # newer than any round the resumed server completed: it did not roll back
    (-1, True),    # no state at all, though its update of round 2 was aggregated
])
def test_a_join_is_checked_against_the_round_its_state_should_be_of(state_round, mismatch, caplog):
    from fedcore.comm.validation import check_join_in
    from fedcore.deployment.deployed_resume import check_state_round
    from fedcore.kernel.message import Message
    # a server resumed from the snapshot of round 3 (round 4 not started), client 5's update of
    # round 2 the last it aggregated
    server = _joining(4, False, {5: 2})
    content = {"client_id": 5, "num_samples": 30, "state_round": state_round}
    assert check_join_in(content, server) is None
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        check_state_round(server, Message("join_in", 5, (0,), 0, 0.0, content))
    listed = server.course.monitor.extra_summary.get("state_mismatch", [])
    assert bool(listed) == mismatch and len(caplog.records) == int(mismatch)
    if mismatch:
        assert listed == [{"client": 5, "state_round": state_round, "expected": [2, 3], "round": 4}]


def test_a_join_declaring_no_state_round_or_a_malformed_one():
    from fedcore.comm.validation import check_join_in
    from fedcore.deployment.deployed_resume import check_state_round
    from fedcore.kernel.message import Message
    server = _joining(4, False, {5: 2})
    check_state_round(server, Message("join_in", 5, (0,), 0, 0.0, {"client_id": 5}))
    assert "state_mismatch" not in server.course.monitor.extra_summary   # keeps no state on disk
    for bad in (-2, 1.5, "3", True):
        assert check_join_in({"client_id": 5, "state_round": bad}, server) == "join_in state_round must be an int >= -1"


def test_latest_with_no_snapshot_yet_starts_a_deployed_course_from_round_1(tmp_path, caplog):
    # what a restarted server gets when it died before its first snapshot
    from fedcore.deployment.distributed import ServerCourse
    cfg = load_config([str(write_cfg(tmp_path / "course.yaml", COURSE))],
                      ["distribute.role=server", "resume_from=latest", f"outdir={tmp_path / 'out'}"])
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        course = ServerCourse(cfg, tmp_path / "out").build()
    assert course.comm.resumed_round == 0 and course.server.round == 1
    assert any("no snapshot in" in r.getMessage() for r in caplog.records)
