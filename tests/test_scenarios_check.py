"""Every shipped scenario loads, builds and passes the completeness check."""
import importlib.util
from pathlib import Path

import pytest

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course

# language-model scenarios need the [llm] extra
_NO_LLM = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("transformers", "peft")),
                             reason="the [llm] extra (transformers, peft) is not installed")
_EXTRA = {"digits_dirichlet": "data", "secure_aggregation": "secagg"}   # scenario -> its extra


def _param(p):
    if p.stem.startswith("llm_"):
        return pytest.param(p, marks=_NO_LLM)
    return pytest.param(p, marks=pytest.mark.extra(_EXTRA[p.stem])) if p.stem in _EXTRA else p


SCENARIOS = [_param(p) for p in sorted((Path(__file__).resolve().parent.parent / "scenarios").glob("*.yaml"))]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_is_a_complete_course(path, tmp_path):
    cfg = load_config(path, [f"outdir={tmp_path}", "verbose=false"])
    course = Course(cfg).build()
    course.write_header()
    result = course.check()
    assert result.complete
    assert (tmp_path / "message_flow.graphml").is_file()
