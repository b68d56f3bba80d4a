"""The time model: profile sources (constants, seeded distributions, traces), the timing
formulas, and per-(client, round) dropouts."""
import json

import numpy as np
import pytest

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.timing import DeviceProfile, TimeModel, expected_work, profile_builders
from tests.conftest import small_cfg

IDS = list(range(1, 41))


def build(spec, seed=0, ids=IDS):
    return profile_builders[spec.get("type", "constant")](spec, ids, seed)


def column(profiles, field):
    return np.array([getattr(profiles[c], field) for c in sorted(profiles)])


def test_constant_profiles_are_shared_and_checked():
    p = build({"type": "constant", "compute_speed": 50, "latency": 0.2})
    assert set(p) == set(IDS) and all(x == DeviceProfile(compute_speed=50.0, latency=0.2) for x in p.values())
    with pytest.raises(ConfigError, match="unknown field 'speed'"):
        build({"type": "constant", "speed": 1})
    with pytest.raises(ConfigError, match="type: random"):
        build({"type": "constant", "compute_speed": {"dist": "uniform", "low": 1, "high": 2}})
    with pytest.raises(ConfigError, match="compute_speed must be > 0"):
        build({"type": "constant", "compute_speed": 0})


@pytest.mark.parametrize("spec, check", [
    ({"dist": "constant", "value": 7}, lambda v: np.all(v == 7)),
    ({"dist": "uniform", "low": 2, "high": 5}, lambda v: np.all((v >= 2) & (v <= 5))),
    ({"dist": "normal", "mean": 10, "std": 0}, lambda v: np.all(v == 10)),
    ({"dist": "normal", "mean": 10, "std": 100, "floor": 3}, lambda v: v.min() == 3 and v.max() > 3),
    ({"dist": "lognormal", "median": 20, "sigma": 0}, lambda v: np.allclose(v, 20)),
    ({"dist": "pareto", "scale": 4, "shape": 1.5}, lambda v: v.min() >= 4),
    ({"dist": "zipf", "scale": 8, "a": 2.0}, lambda v: np.all(np.mod(v, 8) == 0)),
    ({"dist": "zipf", "scale": 8, "a": 2.0, "reciprocal": True},
     lambda v: np.all(v <= 8) and np.allclose(8 / v, np.round(8 / v))),
    ({"dist": "lognormal", "median": 20, "sigma": 3, "floor": 5, "cap": 30},
     lambda v: v.min() >= 5 and v.max() <= 30),
])
def test_distributions_hit_their_hand_computed_supports(spec, check):
    values = column(build({"type": "random", "compute_speed": spec}), "compute_speed")
    assert check(values), values


def test_random_profiles_are_seeded_per_field():
    spec = {"type": "random", "compute_speed": {"dist": "lognormal", "median": 20, "sigma": 1},
            "upload_bandwidth": {"dist": "uniform", "low": 1e3, "high": 1e4}}
    a, b, c = build(spec, seed=5), build(spec, seed=5), build(spec, seed=6)
    assert a == b and a != c
    # adding a field does not reshuffle the others
    more = build(dict(spec, latency={"dist": "uniform", "low": 0, "high": 1}), seed=5)
    assert np.array_equal(column(more, "compute_speed"), column(a, "compute_speed"))
    spread = column(a, "compute_speed")
    assert spread.max() / spread.min() > 5          # heterogeneous, as asked


def test_named_distribution_shorthand_and_dropout_clipping():
    p = build({"type": "lognormal", "median": 100, "sigma": 0, "latency": 0.2})
    assert np.allclose(column(p, "compute_speed"), 100) and np.all(column(p, "latency") == 0.2)
    p = build({"type": "uniform", "field": "dropout", "low": -1, "high": 2})
    d = column(p, "dropout")
    assert d.min() >= 0 and d.max() <= 1
    # a number given for every client is checked as given, not clipped
    for bad in (2, -1):
        with pytest.raises(ConfigError, match=f"dropout must be in \\[0, 1\\], got {float(bad)}"):
            build({"type": "random", "compute_speed": {"dist": "lognormal", "median": 40, "sigma": 0.7},
                   "dropout": bad})
    assert np.all(column(build({"type": "random", "compute_speed": 10, "dropout": 1}), "dropout") == 1)
    with pytest.raises(ConfigError, match="needs 'sigma'"):
        build({"type": "lognormal", "median": 1})
    with pytest.raises(ConfigError, match="time.profiles.compute_speed: a field of its own distribution "
                                          "goes under type: random; type: lognormal is the shorthand"):
        build({"type": "lognormal", "compute_speed": {"dist": "lognormal", "median": 40}})
    with pytest.raises(ConfigError, match="unknown distribution"):
        build({"type": "random", "latency": {"dist": "gamma"}})


def test_csv_trace_by_client_id_and_by_seed(tmp_path):
    f = tmp_path / "devices.csv"
    f.write_text("client_id,compute_speed,latency\n1,10,0.1\n2,20,0.2\n3,30,0.3\n")
    p = build({"type": "trace", "path": str(f)}, ids=[1, 2, 3])
    assert [p[c].compute_speed for c in (1, 2, 3)] == [10, 20, 30]
    assert p[2].upload_bandwidth == DeviceProfile().upload_bandwidth   # missing field: default
    with pytest.raises(ConfigError, match="no row for client 4"):
        build({"type": "trace", "path": str(f)}, ids=[1, 2, 3, 4])
    g = tmp_path / "pool.csv"
    g.write_text("compute_speed\n1\n2\n3\n4\n")
    perm = build({"type": "trace", "path": str(g)}, seed=1, ids=[1, 2, 3, 4])
    assert sorted(x.compute_speed for x in perm.values()) == [1, 2, 3, 4]   # a permutation
    assert perm == build({"type": "trace", "path": str(g)}, seed=1, ids=[1, 2, 3, 4])
    cyc = build({"type": "trace", "path": str(g), "assign": "cycle"}, ids=list(range(1, 7)))
    assert [cyc[c].compute_speed for c in range(1, 7)] == [1, 2, 3, 4, 1, 2]


def test_json_trace_and_bad_traces(tmp_path):
    f = tmp_path / "devices.json"
    f.write_text(json.dumps({"devices": [{"compute_speed": 5, "dropout": 0.5}]}))
    p = build({"type": "trace", "path": str(f)}, ids=[1, 2])
    assert p[1] == p[2] == DeviceProfile(compute_speed=5.0, dropout=0.5)
    with pytest.raises(ConfigError, match="does not exist"):
        build({"type": "trace", "path": str(tmp_path / "none.csv")})
    bad = tmp_path / "bad.csv"
    bad.write_text("speed\n1\n")
    with pytest.raises(ConfigError, match="none of the fields"):
        build({"type": "trace", "path": str(bad)})


def test_a_trace_column_no_profile_field_has_is_named_in_a_warning(tmp_path, caplog):
    # a misspelt column is ignored (a real trace may carry more columns), but not unseen
    f = tmp_path / "devices.csv"
    f.write_text("compute_sped,upload_bandwidth,model\n10,100,a\n")
    with caplog.at_level("WARNING", logger="fedcore.timing"):
        p = build({"type": "trace", "path": str(f)}, ids=[1])
    assert p[1].compute_speed == DeviceProfile().compute_speed and p[1].upload_bandwidth == 100
    assert "columns ignored: compute_sped, model" in caplog.text


def test_time_formulas():
    tm = TimeModel({1: DeviceProfile(compute_speed=200, upload_bandwidth=1000, download_bandwidth=4000,
                                     latency=0.5),
                    2: DeviceProfile(upload_bandwidth=500, latency=0.25)})
    assert tm.compute_time(1, 100) == 0.5
    assert tm.upload_time(1, 2000) == 0.5 + 2.0
    assert tm.download_time(1, 2000) == 0.5 + 0.5
    assert tm.transfer_time(0, 1, 2000) == 1.0 and tm.transfer_time(1, 0, 2000) == 2.5
    assert tm.transfer_time(2, 1, 1000) == (0.25 + 2.0) + (0.5 + 0.25)   # client to client
    assert tm.round_trip_time(1, 100, 2000) == 1.0 + 0.5 + 2.5
    assert TimeModel({}, mode="measured").compute_time(1, 1e9, measured=0.125) == 0.125


def test_dropouts_are_drawn_per_client_and_round():
    tm = TimeModel({1: DeviceProfile(dropout=0.3), 2: DeviceProfile(dropout=0.0),
                    3: DeviceProfile(dropout=1.0)}, seed=4)
    draws = [tm.drops_out(1, r) for r in range(2000)]
    assert draws == [TimeModel(tm.profiles, seed=4).drops_out(1, r) for r in range(2000)]
    assert abs(np.mean(draws) - 0.3) < 0.04
    assert not any(tm.drops_out(2, r) for r in range(50)) and all(tm.drops_out(3, r) for r in range(50))
    assert tm.has_dropouts and not TimeModel({1: DeviceProfile()}).has_dropouts


def test_reply_is_stamped_by_download_compute_and_upload():
    """One client, latency L and compute speed s: joins at L, gets the model at 2L, replies
    after n/s, arriving at 3L + n/s (bandwidth large enough that bytes cost ~nothing)."""
    cfg = small_cfg(None, federate__client_num=1, federate__total_round_num=2, eval__clients=False,
                    train__local_steps=1, train__batch_size=100)
    course = Course(cfg).build()
    n = len(course.data.clients[1].train)
    course.timing.profiles[1] = DeviceProfile(compute_speed=n / 2.0, upload_bandwidth=1e15,
                                              download_bandwidth=1e15, latency=0.5)
    course.run()
    times = [r["virtual_time"] for r in course.monitor.records]
    assert times == pytest.approx([1.5 + 2.0, 1.5 + 2.0 + 3.0], abs=1e-6)


def test_expected_work_counts_gradient_evaluations():
    course = Course(small_cfg(None, train__local_epochs=2)).build()
    n = len(course.data.clients[1].train)
    assert expected_work(course, 1) == 2 * n
    course = Course(small_cfg(None, train__local_steps=2, train__batch_size=n + 5)).build()
    assert expected_work(course, 1) == 2 * n                    # a batch never exceeds the data
    assert expected_work(course, 999) == 1000.0                 # no data here: nominal
