"""The per-algorithm scenarios load, learn well above chance in a few rounds, and compare."""
import json
from pathlib import Path

import pytest

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from fedcore.scenarios import compare_algorithms

SCENARIOS = Path(compare_algorithms.__file__).resolve().parent
NAMES = ["fedprox", "scaffold", "feddyn", "moon", "fedmos"]


@pytest.mark.parametrize("name", NAMES)
def test_scenario_learns_above_chance(name, tmp_path):
    cfg = load_config(SCENARIOS / f"{name}.yaml", ["federate.total_round_num=6"],
                      extra={"outdir": str(tmp_path)})
    assert cfg["algorithm.name"] == name and cfg["data.synthetic.alpha"] == 1.0
    summary = Course(cfg).run()
    assert summary["final_test_acc"] > 2 * 0.1          # ten classes: chance is 0.1


def test_comparison_report_has_time_and_bytes(tmp_path, capsys):
    md = tmp_path / "report.md"
    compare_algorithms.main(["--algorithms", "scaffold", "moon", "--out", str(tmp_path / "runs"),
                             "--markdown", str(md), "--target", "0.2",
                             "federate.total_round_num=2", "train.local_epochs=1", "eval.freq=1"])
    text = md.read_text()
    for label in ("| scaffold |", "| moon |", "| fedavg |", "| fedavg (moon setup) |"):
        assert label in text
    assert "virtual s to target" in text and "MB to target" in text and "acc @" in text
    assert (tmp_path / "runs" / "fedavg_for_scaffold" / "metrics.jsonl").is_file()
    # scaffold moves twice fedavg's bytes on the same setup
    def total(run):
        lines = (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()
        return sum(r["bytes_up"] + r["bytes_down"] for r in map(json.loads, lines))
    assert 1.9 < total("scaffold") / total("fedavg_for_scaffold") < 2.1


UNEQUAL_WORK = {"fednova": ("fednova", "sgd"), "fedavgm": ("fedavg", "sgdm"),
                "fedadagrad": ("fedavg", "adagrad"), "fedadam": ("fedavg", "adam"),
                "fedyogi": ("fedavg", "yogi")}


def test_fednova_and_server_optimizer_scenarios_share_fedavgs_baseline():
    key = compare_algorithms._baseline_key(SCENARIOS / "fedprox.yaml", [])
    for name, (algorithm, kind) in UNEQUAL_WORK.items():
        cfg = load_config(SCENARIOS / f"{name}.yaml")
        assert (cfg["algorithm.name"], cfg["server_optimizer.type"]) == (algorithm, kind)
        assert compare_algorithms._baseline_key(SCENARIOS / f"{name}.yaml", []) == key, name
    base = load_config(SCENARIOS / "fedadam.yaml", compare_algorithms.BASELINE)
    assert (base["algorithm.name"], base["server_optimizer.type"], base["server_optimizer.lr"]) == \
        ("fedavg", "sgd", 1.0)
