"""Snapshots of a vertical course and resuming from them, in simulation: a resumed course equals
the uninterrupted one bit for bit (SplitNN with Adam and seeded gradient noise; HE-LR); a
snapshot or a party's state that is damaged, of another course or missing is refused in one
line; and what the active party tells a passive one at setup is checked."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cryptography", reason="PSI needs the 'vertical' extra (pip install 'fedcore[vertical]')")

import fedcore  # noqa: E402
from fedcore.handlers import vertical as v  # noqa: E402
from fedcore.handlers.vertical_snapshot import SetupRefused, StateMissing  # noqa: E402
from fedcore.kernel.errors import ConfigError  # noqa: E402

BASE = {"seed": 3, "verbose": False, "data.type": "synthetic", "data.partition": "vertical",
        "data.synthetic.samples_per_client": 20, "data.synthetic.dim": 6, "data.synthetic.num_classes": 3,
        "federate.client_num": 3, "federate.total_round_num": 4, "data.test_size": 0.2,
        "vertical.parties": 3, "vertical.keep": 0.9, "vertical.method": "splitnn", "vertical.cut": 3,
        "vertical.bottom_hidden": [4], "vertical.gradient_noise": 0.05,
        "train.batch_size": 8, "train.optimizer.type": "adam", "train.optimizer.lr": 0.01}
HE = {**BASE, "vertical.method": "he_lr", "vertical.parties": 2, "vertical.he.key_bits": 384,
      "model.dtype": "float64", "train.optimizer.type": "sgd", "train.optimizer.lr": 0.2}


def _final(out):
    return torch.load(out / "final_model.pt", weights_only=True)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _interrupted_and_resumed(tmp_path, cfg, at: int):
    """The uninterrupted course, and the same course resumed from its snapshot of round `at`
    (its later snapshots and party states thrown away first, as a kill after round `at` leaves them)."""
    whole, out = tmp_path / "whole", tmp_path / "resumed"
    fedcore.run({**cfg, "outdir": str(whole)})
    fedcore.run({**cfg, "outdir": str(out), "checkpoint.every": 1})
    for r in range(at + 1, cfg["federate.total_round_num"] + 1):
        (out / "checkpoints" / f"round_{r}.pt").unlink()
    fedcore.run({**cfg, "outdir": str(out), "checkpoint.every": 1, "resume_from": "latest"})
    return whole, out


@pytest.mark.parametrize("cfg", [BASE, HE], ids=["splitnn", "he_lr"])
def test_a_resumed_course_equals_the_uninterrupted_one_bit_for_bit(tmp_path, cfg):
    whole, out = _interrupted_and_resumed(tmp_path, cfg, at=2)
    a, b = _final(whole), _final(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recs = _records(out)
    assert [r["round"] for r in recs] == [1, 2, 3, 4]
    assert [r["test_acc"] for r in recs] == [r["test_acc"] for r in _records(whole)]
    assert json.loads((out / "summary.json").read_text())["resumed_from"]["round"] == 2
    # every passive party went back to its own state of round 2, the later one dropped and redone
    for k in range(1, cfg["vertical.parties"]):
        assert sorted(p.name for p in (out / "client_state" / str(k)).iterdir()) == \
            [f"round_{r}.state" for r in (1, 2, 3, 4)]


def test_a_snapshot_resumed_after_the_last_round_finishes_at_once(tmp_path):
    cfg = {**BASE, "federate.total_round_num": 2}
    whole, out = _interrupted_and_resumed(tmp_path, cfg, at=2)
    a, b = _final(whole), _final(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _snapshotted(tmp_path, **over):
    out = tmp_path / "run"
    fedcore.run({**BASE, "federate.total_round_num": 2, "outdir": str(out), "checkpoint.every": 1, **over})
    return out


def test_a_damaged_snapshot_is_refused_in_one_line_and_the_one_before_used(tmp_path, caplog):
    out = _snapshotted(tmp_path)
    snap = out / "checkpoints" / "round_2.pt"
    state = torch.load(snap, weights_only=True)
    name = next(iter(state["parts"]["tensors"]))
    state["parts"]["tensors"][name] = state["parts"]["tensors"][name][:-1]   # one row short
    torch.save(state, snap)
    fedcore.run({**BASE, "federate.total_round_num": 2, "outdir": str(out), "checkpoint.every": 1,
                 "resume_from": "latest"})
    warned = [r.getMessage() for r in caplog.records if "round_2.pt" in r.getMessage()]
    assert any(f"parameter '{name}' is not of the course's shape" in m and "round_1.pt" in m for m in warned), warned
    assert json.loads((out / "summary.json").read_text())["resumed_from"]["round"] == 1


@pytest.mark.parametrize("change", ["nan", "optimizer", "scalar_moment", "records", "other_course"])
def test_a_snapshot_not_intact_or_of_another_course_is_refused(tmp_path, change):
    out = _snapshotted(tmp_path)
    for r in (1, 2):
        snap = out / "checkpoints" / f"round_{r}.pt"
        state = torch.load(snap, weights_only=True)
        if change == "nan":
            next(iter(state["parts"]["tensors"].values())).view(-1)[0] = float("nan")
        elif change == "optimizer":   # Adam's moments of another shape
            state["parts"]["optimizers"]["top"][0]["exp_avg"] = torch.zeros(7, 7)
        elif change == "scalar_moment":   # a scalar where Adam keeps a tensor of the parameter's shape
            state["parts"]["optimizers"]["top"][0]["exp_avg"] = torch.zeros(())
        elif change == "records":
            state["records"] = state["records"].split("\n")[0] if r == 2 else "not json"
        torch.save(state, snap)
    lr = 0.02 if change == "other_course" else 0.01
    with pytest.raises(ConfigError) as err:
        fedcore.run({**BASE, "federate.total_round_num": 2, "outdir": str(out), "checkpoint.every": 1,
                     "resume_from": "latest", "train.optimizer.lr": lr})
    text = str(err.value)
    assert "\n" not in text and text.startswith("resume_from: ") and "round_1.pt" in text
    assert {"nan": "NaN or infinite", "optimizer": "optimizer state 'top' of parameter 0",
            "scalar_moment": "optimizer state 'top' of parameter 0 ('exp_avg') is not of its shape",
            "records": "records", "other_course": "another course's"}[change] in text


def test_a_passive_party_without_its_state_of_the_round_stops_in_one_line(tmp_path):
    out = _snapshotted(tmp_path)
    for f in (out / "client_state" / "2").iterdir():
        f.unlink()
    with pytest.raises(StateMissing) as err:
        fedcore.run({**BASE, "federate.total_round_num": 2, "outdir": str(out), "checkpoint.every": 1,
                     "resume_from": "latest"})
    assert str(err.value).startswith("vertical: party 2 holds no usable state of round 2 (")
    assert "\n" not in str(err.value)


def test_an_altered_party_state_is_refused_and_named(tmp_path):
    out = _snapshotted(tmp_path)
    f = out / "client_state" / "1" / "round_2.state"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(StateMissing, match="party 1 holds no usable state of round 2"):
        fedcore.run({**BASE, "federate.total_round_num": 2, "outdir": str(out), "checkpoint.every": 1,
                     "resume_from": "latest"})
    assert (f.parent / "round_2.state.refused").exists()


class _Party:
    """A passive party as psi_learn sees it (its table: columns, no labels)."""

    def __init__(self):
        cfg = {"federate.total_round_num": 4, "seed": 0, "data.test_size": 0.2, "vertical.standardize": False}
        table = SimpleNamespace(num_classes=0, aligned=lambda ids: SimpleNamespace(ids=ids))
        self.course, self.table, self.triggered = SimpleNamespace(cfg=cfg), table, []

    def trigger(self, event, payload=None):
        self.triggered.append(event)


@pytest.mark.parametrize("content, why", [
    ({"ids": ["a"], "classes": 0, "round": 0}, "names 0 classes, not an int in 1..65536"),
    ({"ids": ["a"], "classes": "3", "round": 0}, "names '3' classes"),
    ({"ids": ["a"], "classes": True, "round": 0}, "names True classes"),
    ({"ids": ["a"], "classes": 10 ** 9, "round": 0}, "names 1000000000 classes"),
    ({"ids": ["a"], "classes": 3, "round": 5}, "names round 5, not a round of this course (0..4)"),
    ({"ids": ["a"], "classes": 3, "round": -1}, "names round -1"),
    ({"ids": ["a"], "classes": 3}, "is not {ids, classes, round}"),
])
def test_a_passive_party_refuses_a_setup_it_cannot_use_in_one_line(content, why):
    """An active party (the project's own psi_finish, one field changed) tells a bad class count
    or round: the passive party stops with one line, before it aligns or trains anything."""
    party = _Party()
    with pytest.raises(SetupRefused) as err:
        v.psi_learn(party, SimpleNamespace(content=content, sender=0))
    assert why in str(err.value) and "\n" not in str(err.value)
    assert party.triggered == [] and party.table.num_classes == 0


def test_a_passive_party_learns_the_class_count_and_round_from_psi_result():
    party = _Party()
    v.psi_learn(party, SimpleNamespace(content={"ids": ["b", "a"], "classes": 3, "round": 2}, sender=0))
    assert party.table.num_classes == 3 and party.resumed_round == 2 and party.triggered == ["aligned"]


def test_with_an_hmac_key_an_altered_snapshot_is_refused_and_the_party_states_are_tagged(tmp_path):
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o600)
    out = _snapshotted(tmp_path, **{"checkpoint.hmac_key_file": str(key)})
    assert (out / "client_state" / "1" / "round_2.state").read_bytes().startswith(b"FCTAG1 ")
    snap = out / "checkpoints" / "round_2.pt"
    raw = bytearray(snap.read_bytes())
    raw[-10] ^= 1
    snap.write_bytes(bytes(raw))
    fedcore.run({**BASE, "federate.total_round_num": 2, "outdir": str(out), "checkpoint.every": 1,
                 "resume_from": "latest", "checkpoint.hmac_key_file": str(key)})
    assert json.loads((out / "summary.json").read_text())["resumed_from"]["round"] == 1


def test_a_simulation_asked_to_stop_stops_after_a_round_every_party_saved_and_resumes(tmp_path, monkeypatch):
    """Ctrl-C (here: the request it makes, in round 2) stops after the next round whose snapshot
    is due (every 2: round 2), and the course resumes from it to the uninterrupted result."""
    from fedcore.handlers import vertical_snapshot as vsnap
    whole, out = tmp_path / "whole", tmp_path / "run"
    fedcore.run({**BASE, "outdir": str(whole)})
    asked = vsnap.VerticalSnapshots.capture

    def capture(self, active, round_):
        if round_ == 1:
            self.stop_requested = True   # what stop_at_round_end's signal handler sets
        asked(self, active, round_)
    monkeypatch.setattr(vsnap.VerticalSnapshots, "capture", capture)
    fedcore.run({**BASE, "outdir": str(out), "checkpoint.every": 2})
    assert [r["round"] for r in _records(out)] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "interrupted"
    monkeypatch.undo()
    fedcore.run({**BASE, "outdir": str(out), "checkpoint.every": 2, "resume_from": "latest"})
    a, b = _final(whole), _final(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
