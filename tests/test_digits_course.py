"""The digits scenario end to end, shortened: FedAvg under Dirichlet(0.5) skew learns real data."""
from __future__ import annotations

from pathlib import Path

import pytest

from fedcore.config import load_config
from fedcore.course import Course

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "digits_dirichlet.yaml"


@pytest.mark.slow
def test_digits_dirichlet_few_rounds_beats_chance(tmp_path):
    cfg = load_config(SCENARIO, [f"outdir={tmp_path}", "verbose=false", "federate.total_round_num=4",
                                 "eval.freq=4", "eval.clients=false"])
    assert cfg["data.type"] == "digits" and 20 <= cfg["federate.client_num"] <= 50
    assert cfg["data.partition"] == "dirichlet" and cfg["data.alpha"] == 0.5
    summary = Course(cfg).run()
    assert summary["rounds"] == 4
    assert summary["final_test_acc"] > 0.6  # chance is 0.1 with ten classes
