"""Robust aggregation rules against hand-computed results, and their composition with FedAvg."""
import pytest
import torch

from fedcore.kernel import registry
from fedcore.kernel.contract import Algorithm, ReceivedUpdate
from fedcore.algorithms.fedavg import FedAvgAggregator, FedAvgTrainer
from fedcore.algorithms.robust import (centered_clip, clip_to_norm, coordinate_median, krum_scores,
                                       krum_select, make_rule, median_reach, trimmed_mean)
from fedcore.algorithms.combine import replace_combination
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731

# b=(0,0) c=(1,0) d=(0,1) a=(.5,.5) e=(10,10); with f=1 each score sums the 2 nearest squared
# distances: a: .5+.5=1, b,c,d: .5+1=1.5, e: 180.5+181=361.5
POINTS = T([[0, 0], [1, 0], [0.5, 0.5], [0, 1], [10, 10]])


def test_krum_scores_by_hand():
    assert krum_scores(POINTS, 1).tolist() == pytest.approx([1.5, 1.5, 1.0, 1.5, 361.5])


def test_krum_picks_the_central_update_and_multi_krum_the_best_m():
    assert krum_select(POINTS, 1) == [2]
    assert krum_select(POINTS, 1, m=3) == [2, 0, 1]  # ties broken by index


def test_krum_needs_enough_updates():
    with pytest.raises(ValueError, match="n > f \\+ 2"):
        krum_scores(POINTS[:3], 1)


def test_coordinate_median_odd_and_even():
    assert coordinate_median(T([[1, 5], [2, -1], [10, 0]])).tolist() == [2, 0]
    assert coordinate_median(T([[1], [3], [5], [100]])).tolist() == [4]


def test_trimmed_mean_drops_extremes_per_coordinate():
    v = T([[1, 8], [2, -4], [3, 0], [100, 2]])
    assert trimmed_mean(v, 0.25).tolist() == [2.5, 1.0]     # k = 1 at each end
    assert trimmed_mean(v, 0.0).tolist() == [26.5, 1.5]     # nothing trimmed: the mean


def test_clip_to_norm():
    assert clip_to_norm(T([3, 4]), 1.0).tolist() == pytest.approx([0.6, 0.8])
    assert clip_to_norm(T([0.3, 0.4]), 1.0).tolist() == pytest.approx([0.3, 0.4])


def test_centered_clip_by_hand():
    # center (0, 0), tau 1, equal weights: (3, 4) is 5 away -> clipped to (0.6, 0.8); (0.5, 0) and
    # (0, -0.5) are within tau. One iteration: v = ((0.6, 0.8) + (0.5, 0) + (0, -0.5)) / 3
    x = T([[3, 4], [0.5, 0], [0, -0.5]])
    v, clipped = centered_clip(x, T([1, 1, 1]), T([0, 0]), 1.0, 1)
    assert v.tolist() == pytest.approx([1.1 / 3, 0.3 / 3]) and clipped == 1
    # weights 2:1:1 and the center (1, 1): x - c = (2, 3) (norm sqrt(13), scaled by 1/sqrt(13)),
    # (-0.5, -1) (norm sqrt(1.25) > 1, scaled by 1/sqrt(1.25)), (-1, -1.5) (norm sqrt(3.25))
    v, clipped = centered_clip(x, T([2, 1, 1]), T([1, 1]), 1.0, 1)
    steps = [(2 / 4 / 13 ** .5, (2, 3)), (1 / 4 / 1.25 ** .5, (-0.5, -1)), (1 / 4 / 3.25 ** .5, (-1, -1.5))]
    assert v.tolist() == pytest.approx([1 + sum(a * d[i] for a, d in steps) for i in (0, 1)]) and clipped == 3


def test_centered_clip_limits():
    x = T([[3, 4], [0.5, 0], [0, -0.5], [-7, 1]])
    w = T([1, 2, 3, 4])
    mean = (x * (w / w.sum())[:, None]).sum(dim=0)
    for center in (T([0, 0]), T([5, -5])):
        # tau = infinity: one iteration from any center is the weighted mean (FedAvg)
        assert centered_clip(x, w, center, float("inf"), 1)[0].tolist() == pytest.approx(mean.tolist())
        # tau = 0: nothing moves the center, however many iterations
        assert centered_clip(x, w, center, 0.0, 5)[0].tolist() == center.tolist()
    # iterating converges to a fixed point v = v + sum p_i clip(x_i - v): more iterations, closer
    far = [centered_clip(x, w, T([0, 0]), 1.0, L)[0] for L in (1, 5, 200, 201)]
    assert (far[3] - far[2]).norm() < 1e-9 < (far[1] - far[0]).norm()


def test_centered_clip_starts_each_round_from_the_last_combined_delta():
    cfg = small_cfg(None, aggregator__robust_rule="centered_clip", aggregator__cc_tau=1.0)
    rule = make_rule(cfg)
    # round 1 from center 0: (3, 4) clipped to (0.6, 0.8), (0, 0.5) kept: v1 = (0.3, 0.65)
    v1, m1 = rule([{"w": T([3, 4])}, {"w": T([0, 0.5])}], [1.0, 1.0], [1, 2], 1)
    assert v1["w"].tolist() == pytest.approx([0.3, 0.65]) and m1["robust_clipped"] == 1
    # round 2 from v1: the same update (3.3, 4.65) - v1 = (3, 4) clipped again, (0.3, 0.65) - v1 = 0
    v2, _ = rule([{"w": T([3.3, 4.65])}, {"w": T([0.3, 0.65])}], [1.0, 1.0], [1, 2], 2)
    assert v2["w"].tolist() == pytest.approx([0.3 + 0.3, 0.65 + 0.4])


def test_centered_clip_from_the_rounds_median_by_hand_carries_nothing_over():
    cfg = small_cfg(None, aggregator__robust_rule="centered_clip", aggregator__cc_tau=1.0,
                    aggregator__cc_center="median")
    rule = make_rule(cfg)
    # median (1, 0); (0,0) - it = (-1, 0) kept, (10, 0) - it = (9, 0) clipped to (1, 0): v = (1, 0)
    v1, m1 = rule([{"w": T([0, 0])}, {"w": T([1, 0])}, {"w": T([10, 0])}], [1.0] * 3, [1, 2, 3], 1)
    assert v1["w"].tolist() == pytest.approx([1, 0]) and m1["robust_clipped"] == 1
    # round 2 starts from its own median (0, 0.5), not from v1: (3, 4) - it = (3, 3.5), norm
    # sqrt(21.25), clipped to norm 1; (0, 0) - it = (0, -0.5) kept; the median's own term is 0
    v2, m2 = rule([{"w": T([3, 4])}, {"w": T([0, 0.5])}, {"w": T([0, 0])}], [1.0] * 3, [1, 2, 3], 2)
    r = 21.25 ** 0.5
    assert v2["w"].tolist() == pytest.approx([3 / r / 3, 0.5 + (3.5 / r - 0.5) / 3]) and m2["robust_clipped"] == 1


@pytest.mark.parametrize("others", [[[0.0], [1.0], [3.0], [7.0]], [[0.0], [2.0], [6.0]], [[5.0], [-1.0]]])
def test_median_reach_is_how_far_one_more_row_moves_the_median(others):
    """Against a brute force: the median of the others plus one row of every value on a grid."""
    rows = torch.tensor(others, dtype=torch.float64)
    medians = [coordinate_median(torch.cat([rows, torch.tensor([[a]], dtype=torch.float64)])).item()
               for a in torch.linspace(-20, 20, 4001).tolist()]
    assert median_reach(rows).tolist() == pytest.approx([max(medians) - min(medians)])


def test_median_reach_needs_two_other_rows():
    with pytest.raises(ValueError, match="two others or more"):
        median_reach(T([[1.0]]))


def _aggregate(rule_name, models, samples, **keys):
    cfg = small_cfg(None, aggregator__robust_rule=rule_name, **keys)
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    agg = FedAvgAggregator(model, cfg, len(models))
    before = agg.global_state["weight"]
    replace_combination(agg, make_rule(cfg), rule_name)
    ups = [ReceivedUpdate(i + 1, {"model": {"weight": T([m]).float()}, "num_samples": n}, 1)
           for i, (m, n) in enumerate(zip(models, samples))]
    metrics = agg.aggregate(ups, 1)
    assert agg.global_state["weight"] is not before and before.abs().sum() == 0  # never mutated
    return agg.global_state["weight"][0].tolist(), metrics


def test_rules_compose_with_fedavg_aggregator():
    models = [[0, 0], [1, 0], [0.5, 0.5], [0, 1], [10, 10]]
    w, m = _aggregate("krum", models, [1, 1, 1, 1, 1], aggregator__byzantine_num=1)
    assert w == pytest.approx([0.5, 0.5]) and m["robust_selected"] == [3]
    # multi-Krum with m = 3 averages clients 3, 1, 2 alike, (1/m) sum (Blanchard et al.):
    # (.5,.5), (0,0), (1,0); with sample weights (2, 1, 1 samples) on request
    w, _ = _aggregate("multi_krum", models, [1, 1, 2, 1, 1], aggregator__byzantine_num=1,
                      aggregator__krum_m=3)
    assert w == pytest.approx([(0.5 + 0 + 1) / 3, (0.5 + 0 + 0) / 3])
    w, _ = _aggregate("multi_krum", models, [1, 1, 2, 1, 1], aggregator__byzantine_num=1,
                      aggregator__krum_m=3, aggregator__weighting="num_samples")
    assert w == pytest.approx([(2 * 0.5 + 0 + 1) / 4, (2 * 0.5 + 0 + 0) / 4])
    w, _ = _aggregate("median", models, [1, 1, 1, 1, 100])
    assert w == pytest.approx([0.5, 0.5])
    w, _ = _aggregate("trimmed_mean", models, [1] * 5, aggregator__trim_ratio=0.2)
    assert w == pytest.approx([0.5, 0.5])  # per coordinate the middle three of five
    w, m = _aggregate("norm_bound", [[3, 4], [0.3, 0.4]], [1, 3], aggregator__norm_bound=1.0)
    assert w == pytest.approx([(0.6 + 3 * 0.3) / 4, (0.8 + 3 * 0.4) / 4]) and m["robust_clipped"] == 1
    # centered clipping's first round is centered on 0: norm_bound's arithmetic, with the
    # paper's 1/n (Karimireddy et al.); with sample weights on request
    w, m = _aggregate("centered_clip", [[3, 4], [0.3, 0.4]], [1, 3], aggregator__cc_tau=1.0)
    assert w == pytest.approx([(0.6 + 0.3) / 2, (0.8 + 0.4) / 2]) and m["robust_clipped"] == 1
    w, m = _aggregate("centered_clip", [[3, 4], [0.3, 0.4]], [1, 3], aggregator__cc_tau=1.0,
                      aggregator__weighting="num_samples")
    assert w == pytest.approx([(0.6 + 3 * 0.3) / 4, (0.8 + 3 * 0.4) / 4]) and m["robust_clipped"] == 1
    w, _ = _aggregate("centered_clip", models, [1, 1, 2, 1, 1], aggregator__cc_tau=1e300)  # the mean
    assert w == pytest.approx([(0 + 1 + 0.5 + 0 + 10) / 5, (0 + 0 + 0.5 + 1 + 10) / 5])
    w, _ = _aggregate("centered_clip", models, [1, 1, 2, 1, 1], aggregator__cc_tau=1e300,
                      aggregator__weighting="num_samples")   # FedAvg
    assert w == pytest.approx([(0 + 1 + 1 + 0 + 10) / 6, (0 + 0 + 1 + 1 + 10) / 6])


def test_rule_refused_with_control_variate_algorithms(monkeypatch):
    monkeypatch.setitem(registry.algorithms._items, "scaffold",
                        Algorithm(FedAvgTrainer, FedAvgAggregator))
    with pytest.raises(ConfigError, match="aggregator.robust_rule: median cannot be combined with "
                                          "algorithm.name scaffold"):
        small_cfg(None, aggregator__robust_rule="median", algorithm__name="scaffold")


def test_bad_robust_keys_fail_at_config_time():
    with pytest.raises(ConfigError, match="aggregator.norm_bound"):
        small_cfg(None, aggregator__robust_rule="norm_bound")
    with pytest.raises(ConfigError, match="aggregator.trim_ratio: must be in"):
        small_cfg(None, aggregator__robust_rule="trimmed_mean", aggregator__trim_ratio=0.5)
    with pytest.raises(ConfigError, match="aggregator.byzantine_num: krum needs more than f \\+ 2 = 6"):
        small_cfg(None, aggregator__robust_rule="krum", aggregator__byzantine_num=4)  # 6 clients
    with pytest.raises(ConfigError, match="aggregator.cc_tau: robust_rule centered_clip needs a radius"):
        small_cfg(None, aggregator__robust_rule="centered_clip")
    with pytest.raises(ConfigError, match="did you mean 'median'"):
        small_cfg(None, aggregator__robust_rule="medain")


def test_centered_clip_from_the_median_needs_three_updates_an_aggregation():
    with pytest.raises(ConfigError, match="aggregator.cc_center: median needs 3 updates per aggregation or more"
                                          ".*a round has at most 2"):
        small_cfg(None, aggregator__robust_rule="centered_clip", aggregator__cc_tau=0.1,
                  aggregator__cc_center="median", federate__sample_client_num=2)
    small_cfg(None, aggregator__robust_rule="centered_clip", aggregator__cc_tau=0.1,
              aggregator__cc_center="median", federate__sample_client_num=3)
    small_cfg(None, aggregator__robust_rule="centered_clip", aggregator__cc_tau=0.1,
              federate__sample_client_num=2)      # the paper's center: no such need


def _final(**overrides):
    # clients of different sizes, so sample weights differ from uniform ones
    course = Course(small_cfg(None, eval__clients=False, data__partition="quantity",
                              data__synthetic__iid=True, **overrides)).build()
    course.run()
    return course.server.aggregator.global_state


@pytest.mark.parametrize("overrides", [
    # DiLoCo's uniform weighting (outer SGD, lr 1: the uniform mean of the clients' models)
    dict(algorithm__name="diloco", train__local_steps=2, train__preserve_optimizer_state=True,
         algorithm__diloco__outer_optimizer="sgd", algorithm__diloco__outer_learning_rate=1.0),
    # the staleness discount of an asynchronous course
    dict(asyn__use=True, asyn__min_received_num=2, federate__sample_client_num=3,
         asyn__staleness_discount="polynomial", federate__total_round_num=4),
])
def test_a_rule_that_changes_nothing_keeps_the_algorithms_weights(overrides):
    # norm_bound with a bound no update reaches is the plain weighted mean: the aggregator's own
    plain = _final(**overrides)
    bounded = _final(aggregator__robust_rule="norm_bound", aggregator__norm_bound=1e9, **overrides)
    assert max(float((plain[k].double() - bounded[k].double()).abs().max()) for k in plain) < 1e-6


@pytest.mark.parametrize("overrides", [
    dict(asyn__use=True, asyn__min_received_num=2),                            # goal of 2
    dict(asyn__use=True, asyn__aggregator="time_up", asyn__time_budget=1.0),   # as few as 1
])
def test_krum_counts_the_updates_an_async_aggregation_has(overrides):
    # six clients per round, but each aggregation holds the goal's updates: Krum cannot score 2
    with pytest.raises(ConfigError, match="an aggregation may have only"):
        small_cfg(aggregator__robust_rule="krum", **overrides)
    small_cfg(aggregator__robust_rule="krum", **dict(overrides, asyn__min_received_num=3))


def test_krum_scores_keep_exact_ties_and_break_them_by_index():
    # f = 0, k = 3 nearest others. Points (2,0) and (1,.5): squared distances from (2,0) are 1.25,
    # 1.25, 13, 5 -> 3 nearest 1.25 + 1.25 + 5 = 7.5; from (1,.5): 1.25, 4, 6.25, 2.25 -> 1.25 +
    # 2.25 + 4 = 7.5. Exactly equal, so Krum takes the lower index.
    x = torch.tensor([[2, 0], [1, .5], [3, .5], [-1, 2], [1, 2]], dtype=torch.float64)
    scores = krum_scores(x, 0)
    assert scores[0].item() == 7.5 and scores[1].item() == 7.5
    assert krum_select(x, 0) == [0]


def test_krum_tells_apart_updates_closer_than_the_mm_form_of_distances_resolves():
    # 30 updates around a unit vector at spreads of 1e-7: the |x|^2 + |y|^2 - 2xy form loses
    # such distances; the scores must equal the ones summed from exact squared differences
    g = torch.Generator().manual_seed(4)
    base = torch.randn(50, generator=g, dtype=torch.float64)
    x = base / base.norm() + 1e-7 * torch.randn(30, 50, generator=g, dtype=torch.float64)
    f = 3
    d2 = [[float(((x[i] - x[j]) ** 2).sum()) for j in range(30)] for i in range(30)]
    expected = [sum(sorted(d2[i][j] for j in range(30) if j != i)[:30 - f - 2]) for i in range(30)]
    got = krum_scores(x, f).tolist()
    assert all(abs(a - b) <= 1e-12 * b for a, b in zip(got, expected))
