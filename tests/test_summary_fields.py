"""Summary fields that behaviours add: one owner per field, JSON values only."""
import json
import math

import pytest

from fedcore.runtime.monitor import Monitor


def test_a_field_belongs_to_the_behaviour_that_wrote_it_first(tmp_path):
    m = Monitor(tmp_path)
    m.add_summary("dp", {"dp_epsilon": 1.5, "dp_mode": "add_remove"})
    m.add_summary("dp", {"dp_epsilon": 2.0})          # its own field: overwritten
    with pytest.raises(ValueError, match="'dp_epsilon' is written by 'dp'; 'attack' may not"):
        m.add_summary("attack", {"attack": "drift", "dp_epsilon": 0.0})
    assert "attack" not in m.extra_summary            # nothing of a refused call is written
    with pytest.raises(ValueError, match="'rounds' is written by 'monitor'"):
        m.add_summary("attack", {"rounds": 7})        # the monitor's own fields are refused too
    with pytest.raises(ValueError, match="is written by 'dp'"):
        m.tally("admission", "dp_mode")
    summary = m.finalize(0.0, None)
    assert summary["dp_epsilon"] == 2.0 and summary["dp_mode"] == "add_remove" and summary["rounds"] == 0


def test_values_must_be_json_and_are_written_strictly(tmp_path):
    import torch
    m = Monitor(tmp_path)
    for bad, why in [(torch.tensor(1.0), "x is a Tensor"), ({1: 2}, "x has the key 1"),
                     ([1, {"a": {2, 3}}], r"x\[1\]\['a'\] is a set"), (object(), "x is a object")]:
        with pytest.raises(TypeError, match=why):
            m.add_summary("b", {"x": bad})
    with pytest.raises(TypeError, match=r"r\['k'\] is a Tensor"):
        m.append_summary("b", "r", {"k": torch.zeros(1)})
    m.add_summary("b", {"x": {"nan": math.nan, "l": [1, "s", None, True, 2.5]}})
    m.finalize(0.0, None)
    text = (tmp_path / "summary.json").read_text()
    assert json.loads(text)["x"] == {"nan": None, "l": [1, "s", None, True, 2.5]}   # NaN -> null
    assert "NaN" not in text


def test_counts_and_bounded_lists():
    m = Monitor(None)
    for kind in ("a", "b", "a"):
        m.tally("admission", "admission", kind)
    m.tally("deployment", "updates_before_join")
    m.tally("deployment", "updates_before_join", by=2)
    for r in range(5):
        m.append_summary("deployment", "dropped", {"round": r}, limit=3)
    assert dict(m.extra_summary) == {"admission": {"a": 2, "b": 1}, "updates_before_join": 3,
                                     "dropped": [{"round": 0}, {"round": 1}, {"round": 2}]}
    with pytest.raises(TypeError):
        m.extra_summary["x"] = 1                       # read-only: written through add_summary
