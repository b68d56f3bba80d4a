"""The trees course (`task: trees`): the server asks, clients answer with sketches, histograms
or trees, the server aggregates (algorithms/trees.py) and asks again until the booster is done.

The flow is the synchronous course's (join, rounds of `models` and `updates`, `all_received`):
every client every round, except in `cyclic` mode, where one client a round is asked, in turn.
The booster is scored on the server's held-out rows whenever it gained trees; at the end it
is written as `final_model.json` in XGBoost's format (`xgboost.Booster(model_file=...)`).
"""
from __future__ import annotations

import logging

import numpy as np

from fedcore.handlers import analytics, join, rounds, training
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.files import write_atomic
from fedcore.kernel.registry import courses

log = logging.getLogger("fedcore.trees")

__all__ = ["ask", "add_up", "score", "install"]


def ask(server, _event=None) -> None:
    """Send the round's request: to every client, or (cyclic, after round 1) to the next in turn."""
    ids = sorted(server.course.client_ids)
    if server.course.cfg["trees.mode"] == "cyclic" and server.round > 1:
        ids = [ids[(server.round - 2) % len(ids)]]
    server.selected = set(ids)
    server.buffer = []
    server.send("models", ids, server.aggregator.broadcast(server.round))


def add_up(server, _event=None) -> None:
    """`all_received`: aggregate, record the round (scored when trees were added); go on or finish."""
    updates, server.buffer = server.buffer, []
    agg, course = server.aggregator, server.course
    fields = {"num_updates": len(updates), **agg.aggregate(updates, server.round)}
    if fields.get("trees_tree_done"):
        fields.update(score(agg.model_json(), course.data.server_test, course.cfg["trees.objective"]))
    course.monitor.record_round(server.round, server.now, fields)
    if not agg.finished and server.round < course.cfg["federate.total_round_num"]:
        server.round += 1
        ask(server)
        return
    if course.outdir is not None:
        write_atomic(course.outdir / "final_model.json", agg.model_json())
    course.monitor.add_summary("trees", {"trees_mode": course.cfg["trees.mode"],
                                         "trees_count": int(fields["trees_count"]),
                                         "trees_base_score": agg.base_score})
    server.trigger("max_rounds_reached")


def score(model_json: bytes, test, objective: str) -> dict[str, float]:
    """Test metrics of the booster on the server's rows (none when it holds none)."""
    if test is None or not len(test.y):
        return {}
    import xgboost as xgb
    from fedcore.algorithms.trees import booster_of
    x = test.x.flatten(1).double().numpy()
    y = test.y.double().numpy()
    pred = booster_of(model_json).predict(xgb.DMatrix(x)).astype(np.float64)
    if objective == "reg:squarederror":
        mse = float(np.mean((pred - y) ** 2))
        return {"test_loss": mse, "test_rmse": mse ** 0.5}
    p = np.clip(pred, 1e-15, 1 - 1e-15)
    return {"test_loss": float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))),
            "test_acc": float(np.mean((pred > 0.5) == (y > 0.5)))}


def _check_data(course) -> None:
    """Refuse, in one line, data the trees cannot be grown from (where the data is at hand)."""
    cfg, data = course.cfg, course.data
    clients = getattr(data, "clients", None) or {}
    rows = sum(len(getattr(c, s).y) for c in clients.values() for s in ("train", "val", "test"))
    if clients and cfg["trees.max_bin"] > rows:
        raise ConfigError(f"trees.max_bin: {cfg['trees.max_bin']} bins for {rows} rows; set "
                          f"trees.max_bin to at most the number of rows")
    if cfg["trees.objective"] == "binary:logistic" and getattr(data, "num_classes", 2) != 2:
        raise ConfigError(f"trees.objective: binary:logistic needs 2 classes, data.type "
                          f"{cfg['data.type']} has {data.num_classes}; choose binary data or "
                          "trees.objective=reg:squarederror")


@courses.register("trees")
def install(course) -> None:
    _check_data(course)
    join.install(course)
    training.install(course)
    s = course.server_table
    s.register("max_rounds_reached", rounds.finish_course, sends=("finish",))
    s.register("all_joined_in", ask, sends=("models",))
    s.register("receiving_updates", analytics.collect_sums, sends=("all_received",))
    s.register("all_received", add_up, sends=("models", "max_rounds_reached"))
