"""Checkpoints: a course resumed from round k continues exactly as the uninterrupted one."""
import json

import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg

TRAINING_FIELDS = ("round", "virtual_time", "num_updates", "bytes_up", "bytes_down", "test_acc",
                   "test_loss", "client_test_acc_mean", "client_test_acc_std", "client_evals")


def _records(path):
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in TRAINING_FIELDS} for r in rows]


def test_resumed_course_equals_uninterrupted(tmp_path):
    common = dict(federate__sample_client_num=3, federate__total_round_num=4,
                  train__optimizer__momentum=0.9, train__preserve_optimizer_state=True)
    full = tmp_path / "full"
    Course(small_cfg(full, checkpoint__every=2, **common)).run()
    ckpt = full / "checkpoints" / "round_2.pt"
    assert ckpt.is_file() and (full / "checkpoints" / "round_4.pt").is_file()

    resumed = tmp_path / "resumed"
    summary = Course(small_cfg(resumed, resume_from=str(ckpt), **common)).run()
    assert _records(resumed) == _records(full)
    a = torch.load(full / "final_model.pt", weights_only=True)
    b = torch.load(resumed / "final_model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    full_summary = json.loads((full / "summary.json").read_text())
    assert summary["bytes_up"] == full_summary["bytes_up"]
    assert summary["virtual_time"] == full_summary["virtual_time"]
    # wall time goes on from the snapshot's: the resumed run's first new record comes later
    resumed_walls = [json.loads(x)["wall_time"] for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert resumed_walls == sorted(resumed_walls)
    assert resumed_walls[2] >= torch.load(ckpt, weights_only=True)["wall_time"] >= resumed_walls[1]


@pytest.mark.parametrize("algorithm", ["scaffold", "feddyn", "fedmos", "diloco"])
def test_server_state_of_algorithms_survives_resume(tmp_path, algorithm):
    extra = {"algorithm__fedmos__server_momentum": 0.5} if algorithm == "fedmos" else {}
    if algorithm == "diloco":
        extra = {"train__local_steps": 2, "train__preserve_optimizer_state": True,
                 "train__optimizer__type": "adamw", "train__optimizer__lr": 0.01}
    common = dict(federate__total_round_num=3, algorithm__name=algorithm, eval__clients=False, **extra)
    Course(small_cfg(tmp_path / "full", checkpoint__every=1, **common)).run()
    Course(small_cfg(tmp_path / "resumed", resume_from=str(tmp_path / "full" / "checkpoints" / "round_1.pt"),
                     **common)).run()
    assert _records(tmp_path / "resumed") == _records(tmp_path / "full")
    a = torch.load(tmp_path / "full" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "final_model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_bad_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        small_cfg(tmp_path, resume_from=str(tmp_path / "none.pt"))
    bogus = tmp_path / "bogus.pt"
    torch.save({"weights": torch.zeros(2)}, bogus)
    with pytest.raises(ConfigError, match="not a fedcore checkpoint"):
        Course(small_cfg(tmp_path / "x", resume_from=str(bogus))).build()
    Course(small_cfg(tmp_path / "y", checkpoint__every=1, federate__total_round_num=1)).run()
    with pytest.raises(ConfigError, match="the course's last"):
        Course(small_cfg(tmp_path / "z", federate__total_round_num=1,
                         resume_from=str(tmp_path / "y" / "checkpoints" / "round_1.pt"))).build()


@pytest.mark.parametrize("strategy", [dict(asyn__use=True, asyn__min_received_num=2),
                                      dict(asyn__overselection=True)])
def test_resume_of_an_async_course_is_refused_at_config_time(tmp_path, strategy):
    # In-flight updates, the buffer and timers are not in a checkpoint: refuse, do not stall.
    common = dict(federate__sample_client_num=3, federate__total_round_num=3, **strategy)
    Course(small_cfg(tmp_path / "full", checkpoint__every=1, **common)).run()
    ckpt = tmp_path / "full" / "checkpoints" / "round_1.pt"
    assert ckpt.is_file()
    with pytest.raises(ConfigError, match="resume_from: a course on asyn"):
        small_cfg(tmp_path / "resumed", resume_from=str(ckpt), **common)


@pytest.mark.parametrize("extra", [
    dict(privacy__dp__mode="central"),                     # the privacy spent must not restart
    dict(privacy__dp__mode="local"),
    dict(federate__sampler="group", federate__sampler_groups=3),   # the group taken next
])
def test_plugin_state_survives_resume(tmp_path, extra):
    common = dict(federate__sample_client_num=2, federate__total_round_num=4, eval__clients=False,
                  **extra)
    Course(small_cfg(tmp_path / "full", checkpoint__every=2, **common)).run()
    Course(small_cfg(tmp_path / "resumed", resume_from=str(tmp_path / "full" / "checkpoints" / "round_2.pt"),
                     **common)).run()
    fields = TRAINING_FIELDS + ("dp_epsilon",)
    rows = lambda p: [{k: r.get(k) for k in fields}
                      for r in map(json.loads, (p / "metrics.jsonl").read_text().splitlines())]
    assert rows(tmp_path / "resumed") == rows(tmp_path / "full")


def test_resume_refuses_a_checkpoint_without_a_plugins_state(tmp_path):
    common = dict(federate__total_round_num=3, eval__clients=False)
    Course(small_cfg(tmp_path / "full", checkpoint__every=1, **common)).run()
    # a server optimizer keeps state (its moments) and is not part of the course's fingerprint
    with pytest.raises(ConfigError, match="holds no state for 'server_optimizer'"):
        Course(small_cfg(tmp_path / "adam", server_optimizer__type="adam",
                         resume_from=str(tmp_path / "full" / "checkpoints" / "round_1.pt"), **common)).build()
    # the privacy mechanism is: a snapshot of a course without DP is another course's
    with pytest.raises(ConfigError, match="snapshot of another course .*privacy.dp.mode"):
        Course(small_cfg(tmp_path / "dp", privacy__dp__mode="central",
                         resume_from=str(tmp_path / "full" / "checkpoints" / "round_1.pt"), **common)).build()


def test_an_unwritable_checkpoint_path_is_a_config_error_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="checkpoint.path: cannot create"):
        Course(small_cfg(tmp_path / "x", checkpoint__every=1, checkpoint__path=str(blocker / "sub"))).build()


@pytest.mark.parametrize("changed", [dict(model__dtype="float64"), dict(model__hidden=[5])])
def test_resume_refuses_a_checkpoint_of_another_shape_or_dtype(tmp_path, changed):
    # same entry names, other shapes or dtype: refused, not a crash in round 1 or a mixed-dtype run
    common = dict(federate__total_round_num=3, model__type="mlp", model__hidden=[4])
    Course(small_cfg(tmp_path / "full", checkpoint__every=1, **common)).run()
    with pytest.raises(ConfigError, match="was written for another model"):
        Course(small_cfg(tmp_path / "r", resume_from=str(tmp_path / "full" / "checkpoints" / "round_1.pt"),
                         **dict(common, **changed))).build()


def test_resume_refuses_a_checkpoint_of_another_algorithm(tmp_path):
    # FedAvg has no server state: SCAFFOLD resumed from it would start from missing control variates
    Course(small_cfg(tmp_path / "full", checkpoint__every=1, federate__total_round_num=3)).run()
    with pytest.raises(ConfigError, match="written by algorithm.name fedavg, not scaffold"):
        Course(small_cfg(tmp_path / "r", federate__total_round_num=3, algorithm__name="scaffold",
                         resume_from=str(tmp_path / "full" / "checkpoints" / "round_1.pt"))).build()


def test_a_snapshot_carries_the_records_as_json_lines_each_encoded_once(tmp_path):
    # A deployed server snapshots every round: its records travel as one JSON text (not
    # thousands of objects for torch's pickler), each encoded once, and come back exactly
    # (NaN included); a snapshot written with a list of records still loads.
    from types import SimpleNamespace
    from fedcore.runtime.checkpoint import Checkpointer, _records_of
    course = SimpleNamespace(cfg={"checkpoint.every": 0, "checkpoint.path": None, "checkpoint.keep": None},
                             wall_clock=False, outdir=None)
    cp = Checkpointer(course)
    records = [{"round": 1, "test_acc": 0.25, "loss": float("nan")}, {"round": 2, "test_acc": 1 / 3}]
    text = cp._records_text(records)
    assert isinstance(text, str) and text.count("\n") == 1
    records.append({"round": 3, "bytes_up": 10})
    records[0]["round"] = 99   # written records are not encoded again
    back = _records_of({"records": cp._records_text(records)})
    assert [r["round"] for r in back] == [1, 2, 3]
    assert back[1]["test_acc"] == 1 / 3 and back[0]["loss"] != back[0]["loss"]   # NaN
    assert _records_of({"records": [{"round": 7}]}) == [{"round": 7}]


def test_checkpoints_of_a_simulated_async_course_are_said_to_be_for_inspection(tmp_path, caplog):
    import logging
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg
    with caplog.at_level(logging.WARNING, logger="fedcore.checkpoint"):
        Course(small_cfg(tmp_path, checkpoint__every=1, asyn__use=True,
                         asyn__aggregator="goal_achieved", asyn__min_received_num=2)).build()
    assert "cannot be resumed from its checkpoints" in caplog.text
