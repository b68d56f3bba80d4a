"""The smallest end-to-end course: it runs, finishes and writes every output file."""
import json

from fedcore.runtime.course import Course
from tests.conftest import small_cfg


def test_small_course_writes_all_outputs(tmp_path):
    summary = Course(small_cfg(tmp_path)).run()
    for name in ("config.yaml", "handlers.txt", "message_flow.graphml", "metrics.jsonl",
                 "final_model.pt", "summary.json"):
        assert (tmp_path / name).is_file(), name
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1, 2]
    assert summary["rounds"] == 2 and 0.0 <= summary["final_test_acc"] <= 1.0
