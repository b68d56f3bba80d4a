"""The custom-handler tutorial's code (docs/examples/loss_goal.py) works as the tutorial says."""
import json
import sys
from pathlib import Path

import networkx as nx

from fedcore.course import Course
from tests.conftest import small_cfg

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


def _cfg(tmp_path, threshold):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return small_cfg(tmp_path, plugins=["loss_goal"], extensions=["loss_goal"],
                         loss_goal__threshold=threshold, federate__total_round_num=5)
    finally:
        sys.path.remove(str(EXAMPLES))


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
