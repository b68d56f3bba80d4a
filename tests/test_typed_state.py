"""Typed server state (fedcore/kernel/server_state.py): one accessor, saved by snapshots generically."""
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from fedcore.runtime.admission import AdmissionState, Returning
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.server_state import (StateError, WorkerStates, decode, registered_states, transient,
                                  worker_state)
from tests.conftest import small_cfg

ROOT = Path(__file__).resolve().parents[1]

# Client 2 sends 30 times its update: the norm rule (ratio 3) refuses it, and clients that
# missed rounds are scaled to the bound as they return, so admission's history matters;
# client 1 adds local DP noise, whose releases the privacy ledger counts.
ADMISSION_AND_DP = dict(federate__sample_client_num=3, federate__total_round_num=6, eval__clients=False,
                        admission__norm_ratio=3.0, attack__type="scaled_replacement", attack__clients=[2],
                        attack__scale=30.0, privacy__dp__mode="local", privacy__dp__noise_multiplier=0.3,
                        privacy__dp__clients=[1])
FIELDS = ("round", "virtual_time", "num_updates", "bytes_up", "bytes_down", "test_acc", "test_loss",
          "dp_epsilon")


def _rows(outdir: Path) -> list[dict]:
    return [{k: r.get(k) for k in FIELDS} for r in map(json.loads, (outdir / "metrics.jsonl").read_text().splitlines())]


def _model(outdir: Path) -> dict:
    return torch.load(outdir / "final_model.pt", weights_only=True)


@pytest.fixture(scope="module")
def full_course(tmp_path_factory):
    """The uninterrupted course, a snapshot after every round."""
    out = tmp_path_factory.mktemp("typed_state") / "full"
    summary = Course(small_cfg(out, checkpoint__every=1, **ADMISSION_AND_DP)).run()
    return out, summary


def test_a_resumed_course_with_admission_and_dp_equals_the_uninterrupted_one(full_course, tmp_path):
    full, full_summary = full_course
    counts = full_summary["admission"]
    assert counts["update norm far above the round's others"] >= 1     # the rule was at work
    assert counts["update of a returning client scaled to the bound"] >= 1
    snapshot = full / "checkpoints" / "round_3.pt"
    summary = Course(small_cfg(tmp_path / "resumed", resume_from=str(snapshot), **ADMISSION_AND_DP)).run()
    assert _rows(tmp_path / "resumed") == _rows(full)
    a, b = _model(full), _model(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert summary["admission"] == counts            # counted from the course's start
    assert summary["dp_epsilon"] == full_summary["dp_epsilon"]

    # the same snapshot without admission's state resumes another course: the state is needed
    state = torch.load(snapshot, weights_only=True)
    del state["states"]["admission"]
    torch.save(state, tmp_path / "cut.pt")
    Course(small_cfg(tmp_path / "cut", resume_from=str(tmp_path / "cut.pt"), **ADMISSION_AND_DP)).run()
    c = _model(tmp_path / "cut")
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_the_snapshot_holds_each_registered_state_that_is_not_transient(full_course):
    full, _ = full_course
    course = Course(small_cfg(None, resume_from=str(full / "checkpoints" / "round_3.pt"),
                              **ADMISSION_AND_DP)).build()
    saved = torch.load(full / "checkpoints" / "round_3.pt", weights_only=True)["states"]
    held = course.server.states.names()
    assert "admission" in held
    assert sorted(saved) == sorted(n for n in held if not getattr(registered_states()[n], "transient", False))
    admission = course.server.state(AdmissionState)
    # 6 clients of 30 samples each, 80% of them for training (small_cfg): each declared 24
    assert admission.declared == {c: 24 for c in range(1, 7)}
    assert saved["admission"]["declared"] == admission.declared
    assert isinstance(admission.history, Returning) and admission.history.first_round == 1
    # the history knows each client's last round, the latest being the snapshot's
    assert max(admission.history.last.values()) == 3
    assert dataclasses.asdict(admission.history) == saved["admission"]["history"]
    assert course.monitor.extra_summary["admission"] == admission.counts


@pytest.mark.extra("secagg")
def test_a_secure_course_saves_its_rounds_and_the_keys_it_has_seen(tmp_path):
    from fedcore.handlers.secagg_blame import SecaggServer
    common = dict(federate__total_round_num=3, eval__clients=False, secure_aggregation__enabled=True)
    Course(small_cfg(tmp_path / "full", checkpoint__every=1, **common)).run()
    saved = torch.load(tmp_path / "full" / "checkpoints" / "round_2.pt", weights_only=True)["states"]
    secure = saved["secure_aggregation"]
    # two rounds aggregated, each of the 6 clients sent two fresh 32-byte public keys per round
    assert secure["aggregated"] == 2 and len(secure["seen_keys"]) == 2 * 6 * 2
    assert all(isinstance(k, bytes) and len(k) == 32 for k in secure["seen_keys"])
    assert set(secure) == {"aggregated", "seen_keys", "seen_inputs"}   # the round in flight is not
    course = Course(small_cfg(tmp_path / "resumed", resume_from=str(tmp_path / "full" / "checkpoints"
                                                                    / "round_2.pt"), **common)).build()
    state = course.server.state(SecaggServer)
    assert state.aggregated == 2 and state.seen_keys == secure["seen_keys"]
    assert state.current is None and state.timeout == 0.0   # transient: as installed


def test_a_state_class_that_is_not_registered_is_refused_in_one_line():
    @dataclasses.dataclass
    class Loose:
        n: int = 0

    with pytest.raises(StateError) as err:
        WorkerStates().get(Loose)
    assert "not a registered worker state" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(StateError, match="must be a dataclass"):
        worker_state("tests.not_a_dataclass")(type("Plain", (), {}))


def test_a_transient_field_is_not_saved_and_anything_else_must_be_plain():
    @worker_state("tests.probe")
    @dataclasses.dataclass
    class Probe:
        seen: set[int] = dataclasses.field(default_factory=set)
        timer: object = transient(object)

    states = WorkerStates()
    states.get(Probe).seen.add(4)
    assert states.saved() == {"tests.probe": {"seen": {4}}}
    restored = decode(states.saved())["tests.probe"]
    assert restored.seen == {4} and restored.timer is not states.get(Probe).timer
    states.get(Probe).seen = {object()}
    with pytest.raises(StateError, match="cannot save"):
        states.saved()


@pytest.mark.parametrize("corrupt, needle", [
    (lambda s: s.update(admission={**s["admission"], "declared": {1: "24"}}), "admission.declared[1] is a str, not int"),
    (lambda s: s["admission"]["history"].update(last=[1, 2]), "admission.history.last is a list"),
    (lambda s: s["admission"].update(rejected_in_a_row=True), "rejected_in_a_row is a bool, not int"),
    (lambda s: s["admission"].update(extra=1), "no field 'extra' in AdmissionState"),
    (lambda s: s.update(unknown={}), "state 'unknown' is not one that this course's behaviours register"),
])
def test_a_corrupted_state_entry_is_refused_in_one_line(full_course, tmp_path, corrupt, needle):
    full, _ = full_course
    state = torch.load(full / "checkpoints" / "round_3.pt", weights_only=True)
    corrupt(state["states"])
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(ConfigError) as err:
        Course(small_cfg(tmp_path / "r", resume_from=str(tmp_path / "bad.pt"), **ADMISSION_AND_DP)).build()
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert "is not a usable snapshot" in str(err.value)


def test_a_deployed_server_resumes_admissions_state_from_a_simulations_snapshot(full_course, tmp_path):
    """The deployed server restores the same states from the same file (its networking is not
    started: building the server course is enough)."""
    from fedcore.deployment.distributed import ServerCourse
    full, _ = full_course
    snapshot = full / "checkpoints" / "round_3.pt"
    cfg = small_cfg(None, resume_from=str(snapshot), distribute__role="server",
                    distribute__server_host="127.0.0.1", distribute__server_port=0, distribute__insecure=True,
                    checkpoint__path=str(tmp_path / "ckpt"), **ADMISSION_AND_DP)
    course = ServerCourse(cfg).build()
    saved = torch.load(snapshot, weights_only=True)["states"]["admission"]
    state = course.server.state(AdmissionState)
    assert state.declared == saved["declared"] and state.counts == saved["counts"]
    assert dataclasses.asdict(state.history) == saved["history"]
    assert course.monitor.extra_summary["admission"] == saved["counts"]
    assert course.server.round == 4


# Probes left on purpose: each asks whether the object in hand is a course's worker at all (a
# bare server object in unit tests, the gRPC service before a worker is attached), not for state.
ALLOWED_PROBES = {
    ("fedcore/comm/sessions.py", 'getattr(self.server, "course", None)'),
    ("fedcore/comm/validation.py", 'getattr(server, "course", None)'),
    ("algorithms/compression.py", 'getattr(server, "course", None)'),
}


def test_no_behaviour_probes_the_server_for_attributes_attached_at_run_time():
    probe = re.compile(r"getattr\((?:self\.server|course\.server|server|s),\s*\"\w+\",[^)]*\)")
    found = set()
    for folder in ("fedcore", "handlers", "algorithms"):
        for path in (ROOT / folder).rglob("*.py"):
            real = path.resolve()   # fedcore/handlers and the like may link to the top-level packages
            for hit in probe.findall(real.read_text()):
                found.add((str(real.relative_to(ROOT.resolve())), hit))
    assert found <= ALLOWED_PROBES, sorted(found - ALLOWED_PROBES)
