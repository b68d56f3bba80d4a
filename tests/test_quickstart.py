"""The shipped quickstart scenario reaches the accuracy its docs promise."""
from pathlib import Path

from fedcore.config import load_config
from fedcore.course import Course

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "quickstart.yaml"


def test_quickstart_reaches_target(tmp_path):
    cfg = load_config(SCENARIO, [f"outdir={tmp_path}", "verbose=false"])
    summary = Course(cfg).run()
    assert summary["rounds"] == 60
    assert summary["final_test_acc"] >= 0.70
    assert summary["time_to_target"] is not None and summary["time_to_target"] < summary["virtual_time"]
