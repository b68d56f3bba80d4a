"""A deployed client keeps its per-course state on its own disk (fedcore/comm/client_state.py):
written atomically after each round it trains, its last two kept, loaded when it restarts,
and put back in step with the round the server asks for. Files that are damaged, of another
course or of another client are refused in one line; a SCAFFOLD client SIGKILLed between two
of its rounds and restarted goes on with its control variate, and the course ends with the
uninterrupted course's model."""
import json
import logging
import signal
import time

import pytest
import torch

from fedcore.comm.client_state import FRESH, ClientStateDir, DurableClientState
from fedcore.runtime.course import Course
from fedcore.kernel.state import MemoryStateStore
import tests.client_kill_plugin  # noqa: F401  (scaffold_held, for the fingerprint of its state)
from tests.conftest import small_cfg
from tests.deploy_helpers import serve_course, text, wait_exit, wait_for, write_cfg

CID = 3


class _Client:
    parent = 0   # the server, as for every client of a star

    def __init__(self, cid):
        self.id = cid


class _Course:
    """What DurableClientState uses of a deployed client's course: its config and store."""

    def __init__(self, cfg):
        self.cfg, self.store = cfg, MemoryStateStore()


def _state(v: float) -> dict:
    return {"c_i": {"w": torch.full((2, 3), v)}, "sampler": {"epoch": 1, "offset": int(v)}}


def _durable(tmp_path, cfg=None):
    course = _Course(cfg or small_cfg())
    client = _Client(CID)
    return DurableClientState(course, client, tmp_path / "state"), course, client


def _train(durable, course, round_: int, v: float) -> None:
    """What the wrapped fit does around a round: agree, 'train' (the state becomes `v`), write."""
    durable.before_training(round_)
    course.store.save(CID, _state(v))
    durable.after_training(round_)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_restarted_client_loads_its_newest_state_and_keeps_two(tmp_path):
    durable, course, client = _durable(tmp_path)
    assert client.state_round == FRESH and course.store.load(CID) == {}
    for r, v in [(1, 1.0), (2, 2.0), (4, 4.0)]:   # not sampled in round 3
        _train(durable, course, r, v)
    assert durable.files.rounds() == [2, 4] and client.state_round == 4
    again, course2, client2 = _durable(tmp_path)    # the same command, a new process
    assert client2.state_round == 4 and again.previous == 2
    loaded = course2.store.load(CID)
    assert torch.equal(loaded["c_i"]["w"], torch.full((2, 3), 4.0)) and loaded["sampler"]["offset"] == 4
    again.before_training(5)                        # what the server expects: nothing to change
    assert torch.equal(course2.store.load(CID)["c_i"]["w"], torch.full((2, 3), 4.0))


def test_a_damaged_state_file_is_refused_in_one_line_and_the_previous_one_used(tmp_path, caplog):
    durable, course, _ = _durable(tmp_path)
    _train(durable, course, 1, 1.0)
    _train(durable, course, 2, 2.0)
    f = durable.files.path(2)
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) // 2])             # cut short, as by a full disk
    with caplog.at_level(logging.INFO, logger="fedcore.deploy"):
        again, course2, client2 = _durable(tmp_path)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert f"{f} is damaged or cut short" in warnings[0]
    assert client2.state_round == 1 and torch.equal(course2.store.load(CID)["c_i"]["w"], torch.full((2, 3), 1.0))
    assert not f.exists() and f.with_name(f.name + ".refused").exists()   # kept aside, not read again


def test_a_flipped_byte_is_refused_too(tmp_path, caplog):
    durable, course, _ = _durable(tmp_path)
    _train(durable, course, 1, 1.0)
    _train(durable, course, 2, 2.0)
    f = durable.files.path(2)
    raw = bytearray(f.read_bytes())
    raw[-40] ^= 0x01                                # inside the tensors' bytes: torch would load it
    f.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        _, course2, client2 = _durable(tmp_path)
    assert len(_warnings(caplog)) == 1 and "checksum does not match" in _warnings(caplog)[0]
    assert client2.state_round == 1


@pytest.mark.parametrize("header, why", [
    (b"not json", "has a header that is not a JSON object"),
    (b"[1, 2]", "has a header that is not a JSON object"),
    (None, "names its previous round 'x', not a round"),
])
def test_a_rewritten_header_with_a_matching_checksum_is_refused_in_one_line(tmp_path, caplog, header, why):
    # whoever can write the folder can recompute the (unkeyed) checksum: the header is still
    # checked, and the file refused and kept aside instead of a traceback at every restart
    import hashlib
    durable, course, _ = _durable(tmp_path)
    _train(durable, course, 1, 1.0)
    _train(durable, course, 2, 2.0)
    f = durable.files.path(2)
    magic, _, rest = f.read_bytes().partition(b"\n")
    _digest, _, body = rest.partition(b"\n")
    line, _, payload = body.partition(b"\n")
    if header is None:
        header = json.dumps({**json.loads(line), "previous": "x"}).encode()
    body = header + b"\n" + payload
    f.write_bytes(magic + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    (f.parent / "round_\u00b2.state").write_bytes(b"")   # a name whose 'digit' int() refuses: ignored
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        _, course2, client2 = _durable(tmp_path)
    assert len(_warnings(caplog)) == 1 and why in _warnings(caplog)[0]
    assert client2.state_round == 1 and f.with_name(f.name + ".refused").exists()


def test_another_courses_state_is_refused_in_one_line_naming_the_keys(tmp_path, caplog):
    durable, course, _ = _durable(tmp_path, small_cfg(seed=1))
    _train(durable, course, 1, 1.0)
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        _, course2, client2 = _durable(tmp_path, small_cfg(seed=0))
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "belongs to another course (its config differs: seed)" in warnings[0]
    assert client2.state_round == FRESH and course2.store.load(CID) == {}


def test_a_key_only_one_process_declares_does_not_refuse_the_state(tmp_path, caplog):
    # The writer had imported a plug-in module that declares one more course key; the reader
    # never did. As at the server's join, a key only one side knows is not a difference; a
    # file naming no course at all is refused.
    files = ClientStateDir(tmp_path / "state", small_cfg(), CID)
    files.fingerprint += ";model.declared_elsewhere=0123456789ab"
    files.write(1, FRESH, _state(1.0))
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        _, course2, client2 = _durable(tmp_path)
    assert _warnings(caplog) == [] and client2.state_round == 1
    assert torch.equal(course2.store.load(CID)["c_i"]["w"], torch.full((2, 3), 1.0))
    files.fingerprint = ""
    files.write(2, 1, _state(2.0))
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        _, _, client3 = _durable(tmp_path)
    assert "round_2.state belongs to another course (its config differs)" in _warnings(caplog)[-1]
    assert client3.state_round == 1


def test_another_clients_state_is_refused(tmp_path, caplog):
    durable, course, _ = _durable(tmp_path)
    _train(durable, course, 1, 1.0)
    other = ClientStateDir(tmp_path / "state", small_cfg(), CID + 1)   # the same folder, by mistake
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        assert other.newest() is None
    assert f"is client {CID}'s state of round 1, not client {CID + 1}'s" in _warnings(caplog)[0]


def test_a_server_resumed_from_an_earlier_round_gets_the_state_of_that_round(tmp_path, caplog):
    durable, course, client = _durable(tmp_path)
    _train(durable, course, 1, 1.0)
    _train(durable, course, 3, 3.0)
    _train(durable, course, 5, 5.0)                 # kept: 3 and 5 (5 trained from 3)
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        durable.before_training(4)                  # the server resumed after round 3
    assert torch.equal(course.store.load(CID)["c_i"]["w"], torch.full((2, 3), 3.0))
    assert client.state_round == 3 and durable.files.rounds() == [3]   # round 5's history undone
    assert "going on from its saved state of round 3" in _warnings(caplog)[0]
    _train(durable, course, 4, 4.5)
    assert durable.files.rounds() == [3, 4] and durable.files.load(4)[1] == 3


def test_a_synchronous_round_run_again_is_trained_from_the_state_before_it(tmp_path):
    durable, course, client = _durable(tmp_path)
    _train(durable, course, 1, 1.0)
    _train(durable, course, 2, 2.0)
    _train(durable, course, 2, 2.5)                 # round 2 again: its updates were discarded
    assert durable.files.load(2)[1] == 1            # trained from round 1's state, not from 2's
    assert durable.files.rounds() == [1, 2]


def test_an_asynchronous_client_trains_on_from_its_state_within_a_round(tmp_path):
    durable, course, client = _durable(tmp_path, small_cfg(asyn__use=True))
    _train(durable, course, 3, 3.0)
    durable.before_training(3)                      # a second model of server round 3: no rewind
    assert torch.equal(course.store.load(CID)["c_i"]["w"], torch.full((2, 3), 3.0))
    assert client.state_round == 3


def test_a_client_that_first_trained_after_the_resumed_round_starts_fresh_as_it_did(tmp_path, caplog):
    durable, course, client = _durable(tmp_path)
    _train(durable, course, 4, 4.0)
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        durable.before_training(2)
    assert course.store.load(CID) == {} and client.state_round == FRESH and durable.files.rounds() == []
    assert "first trained in round 4" in _warnings(caplog)[0]


def test_no_state_consistent_with_the_round_means_fresh_state_and_one_line(tmp_path, caplog):
    durable, course, client = _durable(tmp_path)
    for r in (1, 2, 3):
        _train(durable, course, r, float(r))        # kept: 2 and 3; the state after round 1 is gone
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        durable.before_training(2)                  # the server expects the state after round 1
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "no saved state consistent with round 2" in warnings[0]
    assert "fresh client state" in warnings[0]
    assert course.store.load(CID) == {} and client.state_round == FRESH
    assert durable.files.rounds() == []             # a restart before training loads none of them
    again, course2, _ = _durable(tmp_path)
    assert course2.store.load(CID) == {}


STATEFUL = {   # what each keeps between rounds, in the state store
    "scaffold": {"algorithm__name": "scaffold"},
    "feddyn": {"algorithm__name": "feddyn"},
    "diloco": {"algorithm__name": "diloco", "train__local_steps": 3, "train__preserve_optimizer_state": True,
               "train__optimizer__type": "adamw"},
    "fedrep": {"algorithm__name": "fedrep", "model__type": "mlp", "model__hidden": [6]},
    "pfedme": {"algorithm__name": "pfedme"},
    "ditto": {"personalization__method": "ditto"},
}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_every_algorithms_client_state_comes_back_exactly(tmp_path, name):
    """Each stateful algorithm's client state after two simulated rounds, written and read back."""
    cfg = small_cfg(federate__client_num=2, eval__clients=False, **STATEFUL[name])
    course = Course(cfg).build()
    course.run()
    state = course.store.load(1)
    assert set(state) - {"sampler"}, state.keys()   # something of the algorithm's own
    files = ClientStateDir(tmp_path, cfg, 1)
    files.write(2, 1, state)
    meta, back = files.read(2)
    assert meta == {"fingerprint": files.fingerprint, "client_id": 1, "round": 2, "previous": 1}
    assert _same(state, back)


def test_the_join_declares_the_saved_states_round_and_the_server_accepts_it():
    from fedcore.comm.validation import check_join_in
    from fedcore.handlers.join import join_in

    class Joining(_Client):
        def send(self, msg_type, to, content):
            self.sent = (msg_type, to, content)
    client = Joining(CID)
    join_in(client, None)                           # no saved state: as a simulated client joins
    assert client.sent == ("join_in", 0, {"client_id": CID})
    client.state_round = 4
    join_in(client, None)
    assert client.sent[2] == {"client_id": CID, "state_round": 4}
    assert check_join_in({"client_id": CID, "num_samples": 30, "state_round": 4}, None) is None
    for bad in (-2, "4", 1.5, True):
        assert check_join_in({"client_id": CID, "state_round": bad}, None) == "join_in state_round must be an int >= -1"


# ---------------------------------------------------------------- real processes

ROUNDS, KILL_ROUND = 4, 2


@pytest.mark.slow
def test_a_scaffold_client_sigkilled_and_restarted_goes_on_with_its_control_variate(tmp_path, procs):
    """Client 1 is SIGKILLed once its update of round 2 has left it, while client 2 is held
    before training round 2 (the round cannot end without it); client 1 is restarted with the
    same command, loads its state of round 2, and only then is client 2 let go: rounds 3 and 4
    have all three clients, and the final model is the uninterrupted (simulated) course's."""
    marks = tmp_path / "marks"
    marks.mkdir()
    keys = {"federate.client_num": 3, "federate.total_round_num": ROUNDS, "eval.clients": False}
    cfg = write_cfg(tmp_path / "course.yaml", {
        **keys, "plugins": ["tests.client_kill_plugin"], "algorithm.name": "scaffold_held",
        "kill_test.folder": str(marks), "kill_test.hold_clients": [2], "kill_test.hold_round": KILL_ROUND,
        "kill_test.mark_clients": [1], "kill_test.mark_round": KILL_ROUND,
        "distribute.insecure": True, "distribute.token": "t", "distribute.round_deadline": 300.0,
        "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 1.5,
        "distribute.backoff_initial": 0.1, "distribute.backoff_max": 0.5})
    out = tmp_path / "out"
    server, port, _ = serve_course(procs, cfg, out)

    def client(k, name=None):
        return procs.fedcore(name or f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                             f"distribute.client_id={k}", f"outdir={out}")
    clients = {k: client(k) for k in (1, 2, 3)}

    def sent():
        for p in (server, *clients.values()):
            assert p.poll() is None, text(p)[-3000:]
        return (marks / f"sent_1_{KILL_ROUND}").exists()
    wait_for(sent, 240, "client 1's update of round 2")
    time.sleep(1.0)                                  # on its way over loopback
    clients[1].send_signal(signal.SIGKILL)
    assert clients[1].wait(10) == -signal.SIGKILL

    state_dir = out / "client_state" / "1"
    files = ClientStateDir(state_dir, small_cfg(**{k.replace(".", "__"): v for k, v in keys.items()},
                                                algorithm__name="scaffold_held"), 1)
    assert files.rounds() == [KILL_ROUND - 1, KILL_ROUND]
    meta, saved = files.read(KILL_ROUND)
    assert meta["previous"] == KILL_ROUND - 1
    assert all(t.abs().sum() > 0 for t in saved["c_i"].values())   # a fresh client's would be zero

    restarted = client(1, "client1-restarted")       # the same command
    wait_for(lambda: f"client 1: loaded its state of round {KILL_ROUND}" in text(restarted), 120,
             "the restarted client to load its state")
    time.sleep(1.0)                                  # its join on its way
    (marks / "go").write_text("")
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    for k, p in [(1, restarted), (2, clients[2]), (3, clients[3])]:
        assert wait_exit(p, 60) == 0, text(p)[-3000:]
    server_log = text(server)
    assert "client 1 lost" in server_log and "dropped client" not in server_log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["num_updates"]) for r in records] == [(r, 3) for r in range(1, ROUNDS + 1)]

    sim_dir = tmp_path / "simulated"
    Course(small_cfg(sim_dir, algorithm__name="scaffold",
                     **{k.replace(".", "__"): v for k, v in keys.items()})).run()
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    assert deployed.keys() == simulated.keys()
    for entry in simulated:
        assert torch.allclose(deployed[entry], simulated[entry], rtol=0, atol=1e-6), entry
