"""Dropout-heavy courses finish in every asynchronous mode and in synchronous over-selection
and time_up; every mode is reproducible from its seed."""
import json

import pytest

from fedcore.runtime.course import Course, CourseStalled
from tests.conftest import small_cfg

SPEEDS = {"dist": "lognormal", "median": 50, "sigma": 0.7}
MODES = {
    "async goal/aggr": dict(asyn__use=True, asyn__min_received_num=2),
    "async goal/rece": dict(asyn__use=True, asyn__min_received_num=2,
                            asyn__broadcast_manner="after_receiving"),
    "async time/aggr": dict(asyn__use=True, asyn__aggregator="time_up", asyn__time_budget=1.0),
    "async time/rece": dict(asyn__use=True, asyn__aggregator="time_up", asyn__time_budget=1.0,
                            asyn__broadcast_manner="after_receiving"),
    "fedbuff": dict(asyn__use=True, asyn__min_received_num=2, algorithm__name="fedbuff",
                    asyn__broadcast_manner="after_receiving", asyn__staleness_discount="polynomial"),
    "fedasync": dict(asyn__use=True, asyn__min_received_num=1, algorithm__name="fedasync",
                     asyn__staleness_discount="hinge"),
    "async group": dict(asyn__use=True, asyn__min_received_num=2, federate__sampler="group"),
    "async responsiveness": dict(asyn__use=True, asyn__min_received_num=2,
                                 federate__sampler="responsiveness"),
    "sync over-selection": dict(asyn__overselection=True),
    "sync time_up": dict(asyn__time_budget=1.0),
}


def cfg_for(mode, tmp_path=None, profiles=None, **extra):
    profiles = profiles or {"type": "random", "compute_speed": SPEEDS, "dropout": 0.3}
    return small_cfg(tmp_path, federate__client_num=10, federate__sample_client_num=4,
                     federate__total_round_num=6, eval__freq=3, eval__clients=False,
                     time__profiles=profiles, **MODES[mode], **extra)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_thirty_percent_dropout_per_round_still_finishes(mode):
    course = Course(cfg_for(mode))
    summary = course.run()
    assert summary["rounds"] == 6 and summary["stopped_by"] == "max_rounds"
    assert summary["lost_replies"] > 0          # dropouts did happen


@pytest.mark.parametrize("mode", ["async goal/aggr", "async goal/rece", "sync over-selection",
                                  "sync time_up"])
def test_a_third_of_the_clients_never_reply(mode, tmp_path):
    trace = tmp_path / "devices.json"
    rows = [{"client_id": c, "compute_speed": 20.0 * c, "dropout": 1.0 if c in (2, 5, 9) else 0.0}
            for c in range(1, 11)]
    trace.write_text(json.dumps(rows))
    course = Course(cfg_for(mode, profiles={"type": "trace", "path": str(trace)}))
    summary = course.run()
    assert summary["rounds"] == 6
    assert all(summary["effective_aggregation_counts"][str(c)] == 0 for c in (2, 5, 9))


def test_sync_vanilla_with_dropouts_stalls_with_a_clear_error(tmp_path):
    cfg = small_cfg(tmp_path, federate__client_num=10, federate__total_round_num=6, eval__clients=False,
                    time__profiles={"type": "constant", "dropout": 0.3})
    with pytest.raises(CourseStalled, match="over-selection, time_up or an async strategy"):
        Course(cfg).run()
    # what the course had is kept: its summary says why it stopped, its model is the last one
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by"] == "stalled" and "over-selection" in summary["stalled"]
    assert (tmp_path / "final_model.pt").is_file()


def _metrics(path):
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("wall_time")
    summary = json.loads((path / "summary.json").read_text())
    summary.pop("wall_time")
    summary["final"].pop("wall_time", None)
    return rows, summary


@pytest.mark.parametrize("mode", sorted(MODES))
def test_same_seed_same_metrics(mode, tmp_path):
    outs = []
    for run in ("a", "b"):
        Course(cfg_for(mode, tmp_path / run)).run()
        outs.append(_metrics(tmp_path / run))
    assert outs[0] == outs[1]
    rows, summary = outs[0]
    assert all({"staleness_min", "staleness_mean", "staleness_max", "dropped_stale"} <= set(r)
               for r in rows)
    assert sum(summary["staleness_histogram"].values()) == sum(r["num_updates"] for r in rows)
    assert sum(summary["effective_aggregation_counts"].values()) == sum(r["num_updates"] for r in rows)
