"""Federated statistics (task: analytics) against the same statistics computed centrally.

Expected values come from numpy and from exact rational arithmetic (fractions) on the union
of the clients' rows, never from the code under test; DP's sigma is derived here from the
accountant by an independent search and from the bounds by hand.
"""
import json
import math
from fractions import Fraction

import numpy as np
import pytest

from fedcore.algorithms import analytics_stats as st
from fedcore.algorithms.dp_accountant import dp_epsilon
from fedcore.kernel.config import load_config
from tests.conftest import skip_module_without

skip_module_without("data", "sklearn")   # the wine table; imported where used (seconds to import)

SCENARIO = "scenarios/analytics.yaml"
DP_SCENARIO = "scenarios/analytics_dp.yaml"


def _exact(values: np.ndarray) -> tuple[float, float, float]:
    """(sum, mean, population variance) of float64 values, exactly, then rounded once."""
    fr = [Fraction(v) for v in values]
    n = len(fr)
    mean = sum(fr) / n
    return float(sum(fr)), float(mean), float(sum((v - mean) ** 2 for v in fr) / n)


def _plan(stats, columns, groups=("all",), quantiles=(0.5,), bins=4, rounds=3):
    return st.Plan(frozenset(stats), tuple(columns), tuple(groups), tuple(quantiles), bins, rounds, 64)


# ------------------------------------------------------------------ units
@pytest.mark.parametrize("value", [0, 1, -1, 2 ** 31, -(2 ** 95) + 7, 123456789012345678901234567890])
def test_limbs_round_trip(value):
    assert st.decode(st.encode(value, 4)) == value


def test_limb_runs_add_up_to_the_sum_of_their_values():
    values = [5, -(2 ** 70), 2 ** 69 + 3, -1]
    runs = np.array([st.encode(v, 4) for v in values], dtype=object)
    assert st.decode(list(runs.sum(axis=0))) == sum(values)


def test_sums_of_a_partition_equal_the_union_exactly():
    """Three clients' sums of a skewed, grouped random table: count, sum, mean, variance,
    min, max and histogram equal numpy / exact arithmetic on the union."""
    rng = np.random.default_rng(3)
    rows = np.round(rng.normal([10.0, -2.0], [3.0, 0.5], size=(300, 2)), 3)
    groups = rng.integers(0, 2, size=300)
    cols = [st.Column("a", 0, -5.0, 30.0, tuple(np.linspace(-5, 30, 8))),
            st.Column("b", 1, -6.0, 2.0, (-6.0, -3.0, -2.0, -1.5, 2.0))]
    plan = _plan(st.STATISTICS[:-1], cols, groups=("g0", "g1"))
    blocks = st.base_blocks(plan)
    parts = np.split(np.argsort(rows[:, 0]), [40, 190])   # non-IID: sorted by column a
    replies = [st.local_sums(plan, rows[p], groups[p], blocks) for p in parts]
    extremes = np.array([st.local_extremes(plan, rows[p], groups[p]) for p in parts]).reshape(3, -1, 2)
    ext = np.stack([extremes[:, :, 0].min(0), extremes[:, :, 1].max(0)], axis=1).reshape(-1)
    values = st.released(plan, blocks, st.combine(blocks, replies), None)
    out = st.results(plan, blocks, values, ext, [])
    for c, col in enumerate(cols):
        for g in range(2):
            v = rows[groups == g, c]
            got = out[col.name][f"g{g}"]
            total, mean, var = _exact(v)
            assert got["count"] == len(v)
            assert got["sum"] == total == math.fsum(v)
            assert got["mean"] == mean and got["variance"] == var
            assert got["variance"] == pytest.approx(np.var(v), rel=1e-13)
            assert got["min"] == v.min() and got["max"] == v.max()
            assert got["histogram"]["counts"] == np.histogram(v, bins=col.edges)[0].tolist()


def test_values_outside_the_bounds_are_clipped():
    rows = np.array([[-3.0], [0.5], [9.0]])
    col = st.Column("a", 0, 0.0, 1.0, (0.0, 0.5, 1.0))
    plan = _plan(["sum", "min", "max", "histogram"], [col])
    blocks = st.base_blocks(plan)
    values = st.released(plan, blocks, st.combine(blocks, [st.local_sums(plan, rows, np.zeros(3, int), blocks)]), None)
    out = st.results(plan, blocks, values, np.array(st.local_extremes(plan, rows, np.zeros(3, int))), [])["a"]["all"]
    assert (out["sum"], out["min"], out["max"]) == (1.5, 0.0, 1.0)
    assert out["histogram"]["counts"] == [1, 2]


def test_quantile_refinement_finds_the_inverted_cdf_quantile():
    """Rounds of refinement over two clients locate numpy's inverted_cdf quantile within half
    the final bin width, the width being (hi - lo) / bins^rounds."""
    rng = np.random.default_rng(5)
    rows = rng.exponential(2.0, size=(501, 1))
    col = st.Column("x", 0, 0.0, 40.0, (0.0, 40.0))
    qs = (0.0, 0.1, 0.5, 0.9, 1.0)
    plan = _plan(["quantiles"], [col], quantiles=qs, bins=8, rounds=4)
    parts, groups = [rows[:100], rows[100:]], [np.zeros(100, int), np.zeros(401, int)]
    blocks = st.base_blocks(plan)
    values = st.released(plan, blocks, st.combine(blocks, [st.local_sums(plan, r, g, blocks) for r, g in zip(parts, groups)]), None)
    counts = values[0]
    targets = st.first_targets(plan, blocks, values)
    for _ in range(plan.rounds - 1):
        rb = st.refine_blocks(plan)
        sums = st.combine(rb, [st.local_sums(plan, r, g, rb, targets) for r, g in zip(parts, groups)])
        targets = st.next_targets(plan, targets, st.released(plan, rb, sums, None), counts)
    width = 40.0 / 8 ** 4
    for t in targets:
        truth = np.quantile(rows[:, 0], t.q, method="inverted_cdf")
        assert t.a <= truth <= t.b and t.b - t.a == pytest.approx(width)
        assert abs((t.a + t.b) / 2 - truth) <= width / 2


# ------------------------------------------------------------------ the course
@pytest.fixture(scope="module")
def wine():
    from sklearn.datasets import load_wine
    bunch = load_wine()
    return bunch.data, bunch.target, list(bunch.feature_names)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    import fedcore
    out = tmp_path_factory.mktemp("analytics")
    return fedcore.run(SCENARIO, outdir=str(out), verbose=0)


def test_course_statistics_equal_numpy_on_the_union(plain_run, wine):
    x, y, names = wine
    stats = json.loads((plain_run.outdir / "statistics.json").read_text())
    cfg = load_config(SCENARIO)
    assert stats["columns"] == cfg["analytics.columns"] and stats["groups"] == ["class_0", "class_1", "class_2"]
    width_of = {}
    for name in cfg["analytics.columns"]:
        lo, hi = cfg["analytics.bounds"][name]
        width_of[name] = (hi - lo) / cfg["analytics.quantile_bins"] ** cfg["analytics.quantile_rounds"]
        edges = np.linspace(lo, hi, cfg["analytics.bins"] + 1)
        for g in range(3):
            v = x[y == g, names.index(name)]
            got = stats["statistics"][name][f"class_{g}"]
            total, mean, var = _exact(v)
            assert (got["count"], got["sum"], got["mean"], got["variance"]) == (len(v), total, mean, var)
            assert got["mean"] == pytest.approx(np.mean(v), rel=1e-14)
            assert got["variance"] == pytest.approx(np.var(v), rel=1e-13)
            assert (got["min"], got["max"]) == (v.min(), v.max())
            assert got["histogram"]["counts"] == np.histogram(v, bins=edges)[0].tolist()
            for q in cfg["analytics.quantiles"]:
                found = got["quantiles"][repr(float(q))]
                truth = np.quantile(v, q, method="inverted_cdf")
                assert found["interval"][0] <= truth <= found["interval"][1]
                assert abs(found["value"] - truth) <= width_of[name] / 2 * (1 + 1e-9)


def test_course_records_each_round_and_summarises(plain_run):
    records = plain_run.records
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["num_updates"] == 5 and r["bytes_up"] > 0 and r["bytes_down"] > 0
        assert r["virtual_time"] > 0
    assert records[0]["analytics_rows"] == 178
    widths = [r["analytics_quantile_width"] for r in records]
    assert widths == sorted(widths, reverse=True)
    summary = plain_run.summary
    assert summary["analytics"]["proline"]["class_1"]["count"] == 71
    assert not any("epsilon" in k for k in summary)


def test_partition_is_non_iid():
    """The silos hold different mixes of the cultivars (the scenario's Dirichlet split)."""
    from fedcore.scenarios.data import build_federated_data
    data = build_federated_data(load_config(SCENARIO))
    mixes = [np.bincount(np.concatenate([c.train.y, c.val.y, c.test.y]), minlength=3) for c in data.clients.values()]
    assert sum(m.sum() for m in mixes) == 178
    shares = np.array([m / max(m.sum(), 1) for m in mixes])
    assert shares.max(axis=0).min() - shares.min(axis=0).max() > 0.3


# ------------------------------------------------------------------ DP
def test_dp_sigma_is_the_accountants_and_the_bounds(tmp_path):
    """z meets the target epsilon and no smaller z does (searched here independently), and each
    released sum's sigma is z sqrt(J) Delta, with Delta from the bounds by hand."""
    import fedcore
    result = fedcore.run(DP_SCENARIO, outdir=str(tmp_path), verbose=0)
    cfg = load_config(DP_SCENARIO)
    target, delta, rounds = cfg["analytics.dp.epsilon"], cfg["analytics.dp.delta"], 4
    z = result.summary["analytics_noise_multiplier"]
    assert dp_epsilon(1.0, z, rounds, delta) <= target < dp_epsilon(1.0, z * 0.999, rounds, delta)
    assert result.summary["analytics_dp_epsilon"] == pytest.approx(target, rel=1e-3)
    stats = json.loads((tmp_path / "statistics.json").read_text())
    sigmas = stats["dp"]["sigmas"]
    # round 1: a count block, then per column: sum, squares, histogram, quantile histogram
    j = 1 + 4 * len(cfg["analytics.columns"])
    assert len(sigmas["1"]) == j and sigmas["1"][0] == pytest.approx(z * math.sqrt(j))
    for i, name in enumerate(cfg["analytics.columns"]):
        lo, hi = cfg["analytics.bounds"][name]
        h = (hi - lo) / 2 + 2.0 ** -65   # midpoints exact at F = 64 bits, plus half a step of 2^-64
        assert sigmas["1"][1 + 4 * i: 5 + 4 * i] == pytest.approx(
            [z * math.sqrt(j) * h, z * math.sqrt(j) * h * h, z * math.sqrt(j), z * math.sqrt(j)])
    # refinement rounds: per column, each record moves one sub-bin per quantile
    k = len(cfg["analytics.columns"])
    assert sigmas["4"] == pytest.approx([z * math.sqrt(k) * math.sqrt(len(cfg["analytics.quantiles"]))] * k)


def test_dp_noise_spread_matches_sigma():
    """Over many seeded draws, the noise on a released sum has the sigma the course states."""
    from fedcore.algorithms.analytics import AnalyticsAggregator, AnalyticsRequest, plan_of
    cfg = load_config(DP_SCENARIO, extra={"analytics.dp.epsilon": 4.0})
    plan = plan_of(cfg, (13,), 3)
    agg = AnalyticsAggregator(AnalyticsRequest(plan), cfg, 5)
    blocks = st.base_blocks(plan)
    values = [[0.0] * (len(plan.groups) if b.kind in ("sum", "square") else b.length) for b in blocks]
    draws = np.array([agg.noise(blocks, values, r)[1][0] for r in range(1, 3001)])
    sigma = agg.sigmas[1][1]
    assert sigma == pytest.approx(agg.multiplier * math.sqrt(len(blocks)) * (2.0 + 2.0 ** -65))
    assert abs(draws.mean()) < 4 * sigma / math.sqrt(len(draws))
    assert draws.std() == pytest.approx(sigma, rel=0.06)


# ------------------------------------------------------------------ bad input
def _exit(capsys, *args) -> tuple[int, str]:
    import fedcore.run as run_module
    code = run_module.main(["--cfg", SCENARIO, "verbose=0", *args])
    return code, capsys.readouterr().err.strip()


def test_non_numeric_column_is_refused(tmp_path, capsys):
    csv = tmp_path / "t.csv"
    csv.write_text("city,height,label\nParis,1.5,a\nRome,1.7,b\n")
    code, err = _exit(capsys, "data.type=csv", f"data.root={csv}", "analytics.columns=[height,city]",
                      "analytics.group_by=null", f"outdir={tmp_path / 'o'}")
    assert code == 2 and len(err.splitlines()) == 1
    assert "analytics.columns" in err and "'city'" in err and "not numeric" in err


def test_label_column_is_not_a_statistics_column(tmp_path, capsys):
    csv = tmp_path / "t.csv"
    csv.write_text("height,label\n1.5,a\n1.7,b\n")
    code, err = _exit(capsys, "data.type=csv", f"data.root={csv}", "analytics.columns=[label]",
                      f"outdir={tmp_path / 'o'}")
    assert code == 2 and "analytics.columns" in err and "label column" in err


def test_bins_that_do_not_cover_the_bounds_are_refused(tmp_path, capsys):
    code, err = _exit(capsys, "analytics.bin_edges={alcohol: [12.0, 13.0, 15.0]}", f"outdir={tmp_path}")
    assert code == 2 and len(err.splitlines()) == 1
    assert "analytics.bin_edges" in err and "alcohol" in err and "do not cover" in err


def test_unmeetable_epsilon_is_refused(capsys, tmp_path):
    code, err = _exit(capsys, "--cfg", DP_SCENARIO, "analytics.dp.epsilon=0.001", f"outdir={tmp_path}")
    assert code == 2 and len(err.splitlines()) == 1
    assert "analytics.dp.epsilon" in err and "cannot be met" in err


def test_column_without_bounds_is_refused(capsys, tmp_path):
    code, err = _exit(capsys, "analytics.columns=[alcohol,hue]", f"outdir={tmp_path}")
    assert code == 2 and "analytics.bounds" in err and "'hue'" in err


def test_missing_value_in_a_column_is_refused(tmp_path, capsys):
    csv = tmp_path / "t.csv"
    csv.write_text("height,label\n1.5,a\nnan,b\n")
    code, err = _exit(capsys, "data.type=csv", f"data.root={csv}", "analytics.columns=[height]",
                      "analytics.group_by=null", f"outdir={tmp_path / 'o'}")
    assert code == 2 and "'height'" in err and "line 3" in err


@pytest.mark.parametrize("override", ["topology.edges=2", "asyn.use=true", "executor=processes",
                                      "privacy.dp.mode=central"])
def test_courses_analytics_does_not_run_are_refused(override, capsys, tmp_path):
    code, err = _exit(capsys, override, f"outdir={tmp_path}")
    assert code == 2 and err.startswith(f"fedcore: {override.split('=')[0]}: ") and "task: analytics" in err
