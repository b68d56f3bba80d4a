"""The comparison CLI on a two-member family small enough for a unit test."""
import pytest

from fedcore.kernel.errors import ConfigError
from fedcore.scenarios import compare

BASE = """seed: 0
federate: {client_num: 6, sample_client_num: 3, total_round_num: %d}
data: {type: synthetic, partition: natural, synthetic: {samples_per_client: 30, dim: 8, num_classes: 3}}
train: {batch_size: 10, optimizer: {lr: 0.1}}
eval: {clients: false, target_acc: 0.05}
time: {profiles: {type: random, compute_speed: {dist: lognormal, median: 50, sigma: 1.0}}}
"""


def family(tmp_path, rounds=3, extra=""):
    (tmp_path / "fam.yaml").write_text("name: fam\n" + BASE % rounds)
    (tmp_path / "fam_goal.yaml").write_text("name: fam_goal\n" + BASE % rounds + extra +
                                            "asyn: {use: true, min_received_num: 1}\n")
    return compare.family_files("fam", tmp_path)


def test_family_runs_and_prints_the_table(tmp_path, capsys):
    family(tmp_path)
    assert compare.main(["--family", "fam", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| Sync-Vanilla |" in out and "| Async-Goal-Aggr-Unif |" in out and "1.00x" in out


def test_rows_and_speedups(tmp_path):
    rows = compare.run_family(family(tmp_path), [], log=open("/dev/null", "w"))
    assert [r["strategy"] for r in rows] == ["Sync-Vanilla", "Async-Goal-Aggr-Unif"]
    ref, goal = rows
    assert ref["speedup"] == 1.0
    assert goal["speedup"] == pytest.approx(ref["time_to_target"] / goal["time_to_target"])
    assert goal["time_to_target"] < ref["time_to_target"]   # one update vs the slowest of three


def test_members_must_share_the_setting(tmp_path):
    files = family(tmp_path, extra="model: {type: mlp}\n")
    with pytest.raises(ConfigError, match="model.type"):
        compare.run_family(files, [], log=open("/dev/null", "w"))


def test_the_shipped_family_is_one_setting():
    files = compare.family_files("async_vs_sync")
    assert len(files) == 6
    from fedcore.kernel.config import load_config
    cfgs = [load_config(f) for f in files]
    labels = [compare.strategy_label(c) for c in cfgs]
    assert labels == ["Sync-Vanilla", "Sync-OS", "Async-Goal-Aggr-Unif", "Async-Goal-Aggr-Group",
                      "Async-Goal-Rece-Unif", "Async-Time-Aggr-Unif"]
    assert all(compare._same_setting(cfgs[0], c) is None for c in cfgs)


def test_a_stalled_member_is_reported_and_the_rest_still_run(tmp_path):
    files = family(tmp_path)
    for f in files:   # half the replies are lost: sync vanilla cannot finish, async can
        f.write_text(f.read_text().replace(
            "compute_speed: {dist: lognormal, median: 50, sigma: 1.0}", "compute_speed: 50, dropout: 0.5"))
    rows = compare.run_family(files, [], log=open("/dev/null", "w"))
    assert rows[0]["stalled"] and rows[0]["speedup"] is None
    assert not rows[1]["stalled"] and rows[1]["rounds"] == 3
    assert "| Sync-Vanilla | stalled |" in compare.format_table(rows, 0.05)
