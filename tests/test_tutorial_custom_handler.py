"""The custom-handler tutorial's code (docs/examples/loss_goal.py) works as the tutorial says, and
the tutorial's Python blocks, pasted in order into one module, are that code and run as written."""
import json
import re
import sys
from pathlib import Path

import networkx as nx
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg

DOCS = Path(__file__).resolve().parent.parent / "docs"
EXAMPLES = DOCS / "examples"


def _cfg(tmp_path, threshold, module="loss_goal", folder=EXAMPLES):
    sys.path.insert(0, str(folder))
    try:
        return small_cfg(tmp_path, plugins=[module], extensions=["loss_goal"],
                         loss_goal__threshold=threshold, federate__total_round_num=5)
    finally:
        sys.path.remove(str(folder))


def test_goal_reached_finishes_early_through_the_new_event(tmp_path):
    summary = Course(_cfg(tmp_path, 100.0)).run()
    assert summary["rounds"] < 5
    assert summary["loss_goal"]["round"] == 1
    g = nx.read_graphml(tmp_path / "message_flow.graphml")
    assert g.has_edge("client:receiving_models", "server:receiving_progress")
    assert g.has_edge("server:receiving_progress", "server:loss_goal_reached")
    assert g.has_edge("server:loss_goal_reached", "finish")
    handlers = (tmp_path / "handlers.txt").read_text()
    assert "overwritten: receiving_models: fedcore.handlers.training.train_and_reply replaced by " \
           "loss_goal.train_and_report" in handlers


def test_unreachable_goal_runs_every_round(tmp_path):
    summary = Course(_cfg(tmp_path, 1e-9)).run()
    assert summary["rounds"] == 5 and "loss_goal" not in summary
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_by"] == "max_rounds"


def test_the_goal_round_is_aggregated_as_the_tutorial_explains(tmp_path):
    # a threshold between round 1's and round 2's mean loss: round 2 meets the goal. Each
    # client's report follows its update on the same link, so the round's last update (and its
    # aggregation) comes before the report that meets the goal
    first = Course(_cfg(tmp_path / "a", 100.0)).run()["loss_goal"]["mean_loss"]
    summary = Course(_cfg(tmp_path / "b", first - 1e-9)).run()
    goal = summary["loss_goal"]
    assert goal["round"] == 2 and goal["last_aggregated_round"] == 2 and summary["rounds"] == 2
    # the model it ends with is round 2's: the same as a course of exactly two rounds
    two = small_cfg(tmp_path / "two", federate__total_round_num=2)
    Course(two).run()
    a = torch.load(tmp_path / "b" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "two" / "final_model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_the_tutorial_runs_as_written(tmp_path):
    text = (DOCS / "tutorial_custom_handler.md").read_text()
    code = "\n\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    example = (EXAMPLES / "loss_goal.py").read_text()
    body = example[example.index('"""', 3) + 3:]           # the module without its docstring
    squash = lambda s: re.sub(r"\n\s*\n+", "\n", s).strip()  # noqa: E731 (blank lines aside)
    assert squash(code) == squash(body)
    (tmp_path / "pasted_loss_goal.py").write_text(code)
    summary = Course(_cfg(tmp_path / "out", 100.0, "pasted_loss_goal", tmp_path)).run()
    assert summary["stopped_by"] == "early_stop" and summary["loss_goal"]["round"] == 1
