"""Condition-driven courses on hand-computed timelines: three clients whose rounds take
5 s, 8 s and 12 s end to end (network time ~0), as in the worked example of time-to-accuracy
simulation; plus staleness rules, the course choice and the summary's fairness picture."""
import pytest

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.handlers.asyn import resolve_strategy
from fedcore.runtime.timing import DeviceProfile
from tests.conftest import small_cfg

E2E = {1: 5.0, 2: 8.0, 3: 12.0}


def timeline(rounds=3, dead=(), **overrides):
    """Run the three-client course (clients in `dead` never reply); returns (records, extras)."""
    cfg = small_cfg(None, federate__client_num=3, federate__total_round_num=rounds,
                    train__local_steps=1, train__batch_size=100, eval__clients=False, **overrides)
    course = Course(cfg).build()
    for cid, seconds in E2E.items():
        n = len(course.data.clients[cid].train)   # one step over all samples: work = n
        course.timing.profiles[cid] = DeviceProfile(compute_speed=n / seconds, latency=0.0,
                                                    upload_bandwidth=1e15, download_bandwidth=1e15,
                                                    dropout=1.0 if cid in dead else 0.0)
    if dead:
        course.comm.filters.append(course.timing.keep)
    course.run()
    return course.monitor.records, course.monitor.extra_summary


def times(records):
    return [r["virtual_time"] for r in records]


def test_sync_aggregates_when_the_slowest_replies():
    records, _ = timeline()
    assert times(records) == pytest.approx([12, 24, 36], abs=1e-6)
    assert [r["num_updates"] for r in records] == [3, 3, 3]


def test_goal_of_two_aggregates_at_8s_and_the_12s_update_arrives_stale():
    # t=8: {1, 2} aggregated; 1 and 2 restart (reply at 13 and 16); 3's round-1 update lands
    # at 12 in round 2 with staleness 1; at 13 the goal is met again.
    records, extra = timeline(asyn__use=True, asyn__min_received_num=2)
    assert times(records) == pytest.approx([8, 13, 18], abs=1e-6)
    assert [(r["staleness_min"], r["staleness_max"]) for r in records] == [(0, 0), (0, 1), (0, 1)]
    assert records[1]["staleness_mean"] == 0.5
    assert extra["staleness_histogram"] == {"0": 4, "1": 2}
    assert extra["effective_aggregation_counts"] == {"1": 3, "2": 2, "3": 1}


def test_after_receiving_keeps_every_client_busy():
    # t=5: 1 replies and restarts at once from the round-1 model (back at 10, staleness 1);
    # t=8: goal met, 2 restarts (16); t=10 and t=12 (3, stale) make round 2.
    records, _ = timeline(asyn__use=True, asyn__min_received_num=2,
                          asyn__broadcast_manner="after_receiving")
    assert times(records) == pytest.approx([8, 12, 16], abs=1e-6)
    assert records[1]["staleness_min"] == 1 and records[1]["staleness_max"] == 1


def test_time_up_with_budget_10_aggregates_the_first_two_at_10s():
    records, _ = timeline(asyn__use=True, asyn__aggregator="time_up", asyn__time_budget=10.0)
    assert times(records) == pytest.approx([10, 20, 30], abs=1e-6)
    # round 2: 3's stale update (12) and the restarted 1 (15) and 2 (18)
    assert [r["num_updates"] for r in records] == [2, 3, 2]
    assert records[1]["staleness_max"] == 1


def test_time_up_with_too_few_updates_extends_the_budget():
    # budget 4.5, at least 2 updates: nothing by t=4.5 -> budget extended (no idle client to
    # add); 1 arrives at 5 and 2 at 8, so the extended deadline t=9 aggregates both.
    records, extra = timeline(rounds=1, asyn__use=True, asyn__aggregator="time_up",
                              asyn__time_budget=4.5, asyn__min_received_num=2)
    assert times(records) == pytest.approx([9], abs=1e-6)
    assert records[0]["remedial"] == 1 and extra["remedial_extensions"] == 1
    assert records[0]["num_updates"] == 2


def test_staleness_toleration_drops_and_counts():
    # toleration 0: 3's update (12 s, staleness 1) is dropped; round 2 waits for 1 and 2 (16)
    records, extra = timeline(asyn__use=True, asyn__min_received_num=2, asyn__staleness_toleration=0)
    assert times(records)[:2] == pytest.approx([8, 16], abs=1e-6)
    assert records[1]["dropped_stale"] == 1 and records[1]["staleness_max"] == 0
    assert extra["dropped_stale"] >= 1


def test_sync_overselection_drops_the_straggler_who_never_counts():
    # sample 3 of 3, aggregate the first 2: client 3 is always last and never aggregated
    records, extra = timeline(asyn__overselection=True, federate__sample_client_num=2,
                              asyn__overselection_rate=0.5)
    assert times(records) == pytest.approx([8, 16, 24], abs=1e-6)
    assert extra["strategy"] == "sync over-selection"
    assert extra["effective_aggregation_counts"]["3"] == 0 and extra["clients_never_aggregated"] == 1
    assert all(r["staleness_max"] == 0 for r in records)


def test_sync_round_deadline_is_time_up():
    records, extra = timeline(asyn__time_budget=10.0)
    assert times(records) == pytest.approx([10, 20, 30], abs=1e-6)
    assert extra["strategy"] == "sync time_up"
    assert all(r["staleness_max"] == 0 for r in records)


def test_fedasync_mixes_each_update_on_arrival():
    records, _ = timeline(asyn__use=True, asyn__min_received_num=1, algorithm__name="fedasync")
    assert times(records) == pytest.approx([5, 8, 10], abs=1e-6)


def test_a_silent_client_is_presumed_lost_after_the_reply_timeout():
    # goal 3, client 3 never replies: 1 and 2 are in by 8 s; at 20 s (timeout of the dispatch
    # at 0) client 3 is presumed lost and the server tops up to 3 in flight: 1, 2 and 3 again;
    # client 1 replies at 25 s and completes the goal (1, 2, 1).
    records, extra = timeline(rounds=1, dead=(3,), asyn__use=True, asyn__min_received_num=3,
                              asyn__reply_timeout=20.0)
    assert times(records) == pytest.approx([25], abs=1e-6)
    assert records[0]["presumed_lost"] == 1
    assert extra["lost_replies"] == 2        # both of client 3's replies (sent at 12 s and 32 s)
    assert extra["effective_aggregation_counts"] == {"1": 2, "2": 1, "3": 0}


def test_without_a_timeout_a_silent_client_stalls_the_goal():
    from fedcore.runtime.course import CourseStalled
    with pytest.raises(CourseStalled):
        timeline(rounds=1, dead=(3,), asyn__use=True, asyn__min_received_num=3,
                 asyn__reply_timeout=0.0)


# ---------------------------------------------------------------- configuration
def test_the_resolved_config_reloads_to_the_same_course(tmp_path):
    from fedcore.kernel.config import load_config
    cfg = small_cfg(asyn__use=True, asyn__min_received_num=2)
    cfg.dump(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again["course"] == "async" and again.as_tree() == cfg.as_tree()


def test_asyn_use_selects_the_async_course_and_sync_stays_default():
    assert small_cfg()["course"] == "sync"
    cfg = small_cfg(asyn__use=True)
    assert cfg["course"] == "async" and cfg.get("asyn.use", False) is True
    assert small_cfg(asyn__overselection=True)["course"] == "async"
    assert resolve_strategy(small_cfg(asyn__overselection=True, federate__sample_client_num=4)).concurrency == 6


@pytest.mark.parametrize("sampled, said", [
    (None, "samples no extra client"),                 # all 6 sampled: nothing left to over-select
    (5, "asks 7 clients per round, the course has 6"),  # ceil(5 x 1.3) = 7 > 6
    (4, None),                                        # ceil(4 x 1.3) = 6: as asked
])
def test_overselection_cut_by_the_clients_there_are_is_said(caplog, sampled, said):
    cfg = small_cfg(asyn__overselection=True, federate__sample_client_num=sampled)
    with caplog.at_level("WARNING"):
        Course(cfg).build()
    said_lines = [r.getMessage() for r in caplog.records if "asyn.overselection" in r.getMessage()]
    assert (said_lines == []) if said is None else (len(said_lines) == 1 and said in said_lines[0]), said_lines


def test_a_goal_above_the_concurrency_is_reachable_after_receiving():
    # after_receiving tops clients up on every arrival, so the buffer grows past the concurrency
    summary = Course(small_cfg(asyn__use=True, asyn__broadcast_manner="after_receiving",
                               federate__sample_client_num=2, asyn__min_received_num=3)).run()
    assert summary["rounds"] == 2


def test_goal_from_rate_and_defaults():
    st = resolve_strategy(small_cfg(asyn__use=True, federate__sample_client_num=4,
                                    asyn__min_received_rate=0.5))
    assert (st.trigger, st.goal, st.concurrency, st.toleration) == ("goal_achieved", 2, 4, 10)
    st = resolve_strategy(small_cfg(asyn__use=True, asyn__aggregator="time_up", asyn__time_budget=3.0))
    assert st.goal == 1 and st.budget == 3.0


@pytest.mark.parametrize("overrides, match", [
    ({"asyn__use": True, "asyn__aggregator": "time_up"}, "time_budget"),
    ({"asyn__broadcast_manner": "after_receiving"}, "after_receiving is asynchronous"),
    ({"asyn__use": True, "asyn__min_received_num": 2, "asyn__min_received_rate": 0.5}, "both set"),
    ({"asyn__use": True, "asyn__staleness_discount": "cubic"}, "not one of"),
    ({"asyn__time_budget": 2.0, "federate__sample_client_num": 2, "asyn__min_received_num": 3},
     "exceeds the 2 clients"),
    # after_aggregating never has more than the concurrency in flight: the goal cannot be met
    ({"asyn__use": True, "federate__sample_client_num": 2, "asyn__min_received_num": 3},
     "exceeds the 2 clients kept in flight"),
])
def test_bad_async_configs_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        small_cfg(**overrides)
