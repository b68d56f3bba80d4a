"""Outputs written outside the course's own writer (the analytics course's statistics.json, a
study's outputs, the TensorBoard logger's folder), tested as the attacker who can write the outdir
and plants a link at an output's name before the run, as tests/test_file_safety.py does for a
course's outputs: the link is replaced, never followed, and the files are 0600 (outputs.private)."""
import json
import logging
import os

import fedcore
import pytest

from tests.conftest import need_extra
from tests.test_file_safety import VICTIM, _mode, _victim


def test_analytics_writes_no_statistics_through_a_planted_link(tmp_path):
    need_extra("data", "sklearn")
    victim = _victim(tmp_path)
    out = tmp_path / "run"
    out.mkdir(mode=0o700)
    (out / "statistics.json").symlink_to(victim)
    fedcore.run("scenarios/analytics.yaml", outdir=str(out), verbose=0)
    assert victim.read_bytes() == VICTIM
    assert not (out / "statistics.json").is_symlink() and _mode(out / "statistics.json") == 0o600


def test_a_study_writes_nothing_through_links_planted_in_its_outdir(tmp_path):
    from fedcore.tune import tune
    from tests.test_tune_methods import BASE, SPACE
    out = tmp_path / "study"
    out.mkdir(mode=0o700)
    names = ("base.yaml", "trials.csv", "study.json", "best_config.yaml")
    victims = {}
    for name in names:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        victims[name] = _victim(folder)
        (out / name).symlink_to(victims[name])
    tune({**BASE, "federate.total_round_num": 1}, SPACE, "random", trials=1, seed=0, outdir=out)
    written = [name for name, victim in victims.items() if victim.read_bytes() != VICTIM]
    assert written == []


def test_the_tensorboard_logger_writes_nothing_through_a_link_at_its_folder(tmp_path):
    need_extra("tensorboard")
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    out.mkdir(mode=0o700)
    (out / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
    Course(small_cfg(out, loggers=["tensorboard"])).run()
    assert list(elsewhere.iterdir()) == []


def _study(out, trials=1):
    from fedcore.tune import tune
    from tests.test_tune_methods import BASE, SPACE
    return tune({**BASE, "federate.total_round_num": 1}, SPACE, "random", trials=trials, seed=0, outdir=out)


def test_a_link_at_trials_jsonl_is_neither_read_nor_written_and_the_outputs_are_private(tmp_path, caplog):
    victim = _victim(tmp_path)
    out = tmp_path / "study"
    out.mkdir(mode=0o700)
    (out / "trials.jsonl").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="fedcore.tune"):
        _study(out)
    assert victim.read_bytes() == VICTIM
    assert any("trials.jsonl: not read" in r.getMessage() for r in caplog.records)
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in rows] == [0]
    names = ["base.yaml", "trials.jsonl", "trials.csv", "study.json", "best_config.yaml"]
    if (out / "plot.png").exists():
        names.append("plot.png")
    for name in names:
        assert not (out / name).is_symlink() and _mode(out / name) == 0o600, name


def test_a_study_skips_a_line_of_trials_jsonl_that_is_not_a_row_and_keeps_the_others(tmp_path, caplog):
    out = tmp_path / "study"
    _study(out)
    [row] = (out / "trials.jsonl").read_text().splitlines()
    (out / "trials.jsonl").write_text(row + "\n" + row[: len(row) // 2] + "\n")   # a write cut short
    with caplog.at_level(logging.WARNING, logger="fedcore.tune"):
        _study(out, trials=2)
    assert any("trials.jsonl:2: not a recorded evaluation" in r.getMessage() for r in caplog.records)
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in rows] == [0, 1] and rows[0] == json.loads(row)


def test_the_tensorboard_logger_makes_a_private_folder_of_private_files(tmp_path):
    need_extra("tensorboard")
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg
    out = tmp_path / "run"
    out.mkdir(mode=0o700)
    Course(small_cfg(out, loggers=["tensorboard"])).run()
    folder = out / "tensorboard"
    files = [f for f in folder.iterdir() if f.is_file()]
    assert _mode(folder) == 0o700 and files
    assert {f.name: _mode(f) for f in files} == {f.name: 0o600 for f in files}


def test_the_secagg_roster_is_written_through_no_planted_link(tmp_path):
    need_extra("secagg")
    from fedcore.algorithms.secagg_identity import load_roster, write_roster
    victim = _victim(tmp_path)
    out = tmp_path / "keys"
    out.mkdir(mode=0o700)
    (out / "secagg_roster.json").symlink_to(victim)
    path, keys = write_roster(out, [1, 2])
    assert victim.read_bytes() == VICTIM
    assert not path.is_symlink() and sorted(load_roster(path)) == [1, 2] and sorted(keys) == [1, 2]
