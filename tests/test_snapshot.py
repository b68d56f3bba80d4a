"""Snapshot files: `latest`, a corrupted or truncated newest one, another course's, pruning."""
import json
import logging

import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg

COMMON = dict(federate__total_round_num=4, algorithm__name="scaffold", eval__clients=False)


def _final(out):
    return torch.load(out / "final_model.pt", weights_only=True)


def _rounds(out):
    return [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted course, a snapshot after every round (all kept)."""
    out = tmp_path_factory.mktemp("full")
    Course(small_cfg(out, checkpoint__every=1, **COMMON)).run()
    return out


def test_latest_is_the_newest_complete_snapshot_and_a_half_written_one_is_ignored(tmp_path, full):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for k in (1, 2):
        (run / "checkpoints" / f"round_{k}.pt").write_bytes((full / "checkpoints" / f"round_{k}.pt").read_bytes())
    (run / "checkpoints" / "round_3.tmp").write_bytes(b"\x00" * 10)   # a write killed midway
    Course(small_cfg(run, resume_from="latest", **COMMON)).run()
    assert _rounds(run) == [1, 2, 3, 4]
    a, b = _final(full), _final(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_newest_snapshot_is_refused_in_one_line_and_the_one_before_used(tmp_path, full, damage, caplog):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for k in (1, 2):
        (run / "checkpoints" / f"round_{k}.pt").write_bytes((full / "checkpoints" / f"round_{k}.pt").read_bytes())
    newest = run / "checkpoints" / "round_2.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2] if damage == "truncated"
                       else data[:200] + bytes(b ^ 0xFF for b in data[200:400]) + data[400:])
    with caplog.at_level(logging.WARNING, logger="fedcore.checkpoint"):
        Course(small_cfg(run, resume_from="latest", **COMMON)).run()
    warned = [r.getMessage() for r in caplog.records if "using the snapshot before it" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "round_2.pt" in warned[0], warned
    assert _rounds(run) == [1, 2, 3, 4]   # resumed from round 1: rounds 2-4 run again
    a, b = _final(full), _final(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_snapshot_of_another_course_is_refused_in_one_line(tmp_path, full):
    with pytest.raises(ConfigError) as err:
        Course(small_cfg(tmp_path, resume_from=str(full / "checkpoints" / "round_2.pt"),
                         seed=7, **COMMON)).build()
    assert "is a snapshot of another course (keys seed differ" in str(err.value)
    assert "\n" not in str(err.value)


def test_latest_without_any_snapshot_says_where_it_looked(tmp_path):
    with pytest.raises(ConfigError, match="latest: no snapshot in"):
        Course(small_cfg(tmp_path, resume_from="latest", **COMMON)).build()


def test_checkpoint_keep_leaves_the_newest_and_the_latest_pointer(tmp_path):
    Course(small_cfg(tmp_path, checkpoint__every=1, checkpoint__keep=2, **COMMON)).run()
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "round_3.pt", "round_4.pt"]
    assert (folder / "latest").read_text() == "round_4.pt\n"


def test_an_interrupt_during_the_write_lands_after_it(tmp_path):
    # Ctrl-C while a snapshot is written: the snapshot is complete and named by `latest`,
    # and only then does the interrupt reach the process (as KeyboardInterrupt, not as an
    # error from inside torch.save)
    import os
    import signal
    import threading
    import time

    import torch
    from fedcore.runtime.snapshot import write_snapshot

    state = {"w": torch.arange(30_000_000, dtype=torch.float32)}   # 120 MB: a write that takes a while

    def interrupt_mid_write():   # once the temporary file exists: the write has begun
        for _ in range(2000):
            if (tmp_path / "round_7.tmp").exists():
                break
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt_mid_write).start()
    with pytest.raises(KeyboardInterrupt):
        write_snapshot(state, tmp_path, 7, keep=2)
        time.sleep(5)   # not reached if the interrupt was held back until the write ended
    assert (tmp_path / "latest").read_text().strip() == "round_7.pt"
    assert torch.equal(torch.load(tmp_path / "round_7.pt", weights_only=True)["w"], state["w"])


def _reads(monkeypatch) -> list[str]:
    """The snapshot files the course reads."""
    from fedcore.runtime import snapshot_input
    read, real = [], snapshot_input._readable
    monkeypatch.setattr(snapshot_input, "_readable", lambda path, key=None: read.append(path) or real(path, key))
    return read


def test_a_run_folder_as_resume_from_resumes_from_its_newest_snapshot(tmp_path, full, monkeypatch):
    """`resume_from=<a run's outdir>`: its checkpoints folder's newest complete round_<k>.pt
    (round 2 here, a half-written round 3 ignored), so the course ends as the uninterrupted one."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for k in (1, 2):
        (run / "checkpoints" / f"round_{k}.pt").write_bytes((full / "checkpoints" / f"round_{k}.pt").read_bytes())
    (run / "checkpoints" / "round_3.tmp").write_bytes(b"\x00" * 10)
    (run / "checkpoints" / "latest").write_text("round_2.pt\n")
    read = _reads(monkeypatch)
    Course(small_cfg(run, resume_from=str(run), **COMMON)).run()
    assert read == [str(run / "checkpoints" / "round_2.pt")]
    assert _rounds(run) == [1, 2, 3, 4]
    a, b = _final(full), _final(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_folder_named_directly_resumes_from_its_newest_snapshot(tmp_path, full, monkeypatch):
    run = tmp_path / "run"
    saved = tmp_path / "saved"
    saved.mkdir()
    for k in (1, 2):
        (saved / f"round_{k}.pt").write_bytes((full / "checkpoints" / f"round_{k}.pt").read_bytes())
    read = _reads(monkeypatch)
    Course(small_cfg(run, resume_from=str(saved), **COMMON)).run()
    assert read == [str(saved / "round_2.pt")]
    assert _rounds(run) == [1, 2, 3, 4]   # rounds 1-2 from the snapshot's records, 3-4 run again
    a, b = _final(full), _final(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_folder_without_a_snapshot_says_in_one_line_where_it_looked(tmp_path, capsys):
    from fedcore.run import main
    empty = tmp_path / "old_run"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "checkpoints" / "round_2.tmp").write_bytes(b"\x00")   # never completed
    code = main(["--cfg", "scenarios/quickstart.yaml", f"outdir={tmp_path / 'new'}", f"resume_from={empty}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"fedcore: resume_from: no snapshot in the folder '{empty}': looked for "
                             f"round_<k>.pt (and the latest pointer) in '{empty / 'checkpoints'}' and in '{empty}'")
