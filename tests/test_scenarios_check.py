"""Every shipped scenario loads, builds and passes the completeness check."""
from pathlib import Path

import pytest

from fedcore.config import load_config
from fedcore.course import Course

SCENARIOS = sorted((Path(__file__).resolve().parent.parent / "scenarios").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_is_a_complete_course(path, tmp_path):
    cfg = load_config(path, [f"outdir={tmp_path}", "verbose=false"])
    course = Course(cfg).build()
    course.write_header()
    result = course.check()
    assert result.complete
    assert (tmp_path / "message_flow.graphml").is_file()
