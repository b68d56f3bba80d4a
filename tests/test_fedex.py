"""FedEx: the exponentiated-gradient step against a hand-computed example, and the plug-in
inside courses (one candidate is the plain course; resumes exactly; prefers the good arm)."""
import math

import numpy as np
import pytest
import torch

from fedcore.algorithms.fedex import ExpGradPolicy, draw_arm
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg


def test_two_rounds_equal_the_hand_computed_update():
    p = ExpGradPolicy(3)                       # eta0 = sqrt(2 ln 3), eta_t = eta0 / sqrt(t), baseline 0
    eta0 = math.sqrt(2 * math.log(3))
    # round 1: clients drew arms 0, 2, 0; validation losses after training 1.2, 0.6, 1.0 on
    # validation sets of 10, 20, 10 samples -> weights 1/4, 1/2, 1/4; no baseline yet
    m1 = p.step([0, 2, 0], [1.2, 0.6, 1.0], [10, 20, 10])
    g = [0.25 * 1.2 * 3 + 0.25 * 1.0 * 3, 0.0, 0.5 * 0.6 * 3]          # = 1.65, 0, 0.9
    z = [-math.log(3) - eta0 * gj for gj in g]
    norm = math.log(sum(math.exp(v) for v in z))
    theta1 = [math.exp(v - norm) for v in z]
    assert p.theta.tolist() == pytest.approx(theta1, rel=1e-13, abs=0)
    assert theta1 == pytest.approx([0.0641873309, 0.7407084818, 0.1951041872], abs=1e-10)
    assert m1["fedex_mle_arm"] == 1 and m1["fedex_max_prob"] == pytest.approx(max(theta1), rel=1e-13)
    # round 2: arms 1, 2; losses 0.5, 0.7; sizes 30, 10 -> weights 3/4, 1/4; the baseline is round
    # 1's weighted loss 0.25*1.2 + 0.5*0.6 + 0.25*1.0 = 0.85; step eta0 / sqrt(2)
    p.step([1, 2], [0.5, 0.7], [30, 10])
    lam = 0.85
    g2 = [0.0, 0.75 * (0.5 - lam) / theta1[1], 0.25 * (0.7 - lam) / theta1[2]]
    z2 = [math.log(t) - eta0 / math.sqrt(2) * gj for t, gj in zip(theta1, g2)]
    norm2 = math.log(sum(math.exp(v) for v in z2))
    theta2 = [math.exp(v - norm2) for v in z2]
    assert p.theta.tolist() == pytest.approx(theta2, rel=1e-12, abs=0)
    assert theta2 == pytest.approx([0.0466225282, 0.7800347261, 0.1733427457], abs=1e-10)
    assert p.theta.dtype == np.float64 and p.theta.sum() == pytest.approx(1.0, abs=1e-15)


def test_diff_feedback_discounted_baseline_and_constant_step():
    p = ExpGradPolicy(2, eta0=0.5, schedule="constant", baseline=0.5, diff=True)
    p.step([0, 1], [1.0, 2.0], [1, 1], before=[1.5, 1.5])      # changes -0.5, +0.5; baseline 0
    t1 = [math.exp(-0.5 * (0.5 * -0.5 * 2)), math.exp(-0.5 * (0.5 * 0.5 * 2))]
    t1 = [t / sum(t1) for t in t1]
    assert p.theta.tolist() == pytest.approx(t1, rel=1e-13)
    p.step([0, 0], [1.0, 1.0], [1, 1], before=[1.0, 1.0])      # mean change 0 again
    p.step([1], [0.0], [1], before=[1.0])                        # mean change -1
    # the next round's baseline: rounds' mean changes 0, 0, -1 discounted by 0.5 per round back
    assert p.baseline() == pytest.approx((0.25 * 0.0 + 0.5 * 0.0 + 1.0 * -1.0) / 1.75, rel=1e-15)


def test_arms_are_each_clients_own_seeded_draw():
    theta = np.array([0.2, 0.5, 0.3])
    draws = [draw_arm(theta, 0, c, 1) for c in range(1, 400)]
    assert draws == [draw_arm(theta, 0, c, 1) for c in range(1, 400)]
    assert draws != [draw_arm(theta, 0, c, 2) for c in range(1, 400)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.abs(freq - theta).max() < 0.08


def _run(tmp_path=None, **kw):
    cfg = small_cfg(tmp_path, **{"federate.total_round_num": 4, "data.splits": [0.6, 0.2, 0.2], **kw})
    course = Course(cfg).build()
    summary = course.run()
    return course, summary


def _same_course(a, b):
    sa, sb = a.server.aggregator.global_state, b.server.aggregator.global_state
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # FedEx's own payload (theta down, feedback up) adds bytes and so transfer time, nothing else
    for x, y in zip(a.monitor.records, b.monitor.records):
        assert y["bytes_up"] > x["bytes_up"] and y["virtual_time"] > x["virtual_time"]
    drop = ("wall_time", "bytes_up", "bytes_down", "bytes_up_total", "bytes_down_total", "bytes_total",
            "virtual_time", "fedex_entropy", "fedex_max_prob", "fedex_mle_arm")
    ra = [{k: v for k, v in r.items() if k not in drop} for r in a.monitor.records]
    rb = [{k: v for k, v in r.items() if k not in drop} for r in b.monitor.records]
    assert ra == rb and len(ra) == 4


@pytest.mark.parametrize("algorithm, lr", [("fedavg", 0.1), ("fedavg", 0.3), ("fedprox", 0.1)])
def test_a_single_candidate_is_the_plain_course(algorithm, lr):
    plain, _ = _run(**{"algorithm.name": algorithm, "train.optimizer.lr": lr})
    fedex, summary = _run(**{"algorithm.name": algorithm, "fedex.candidates": [{"train.optimizer.lr": lr}]})
    _same_course(plain, fedex)
    assert summary["fedex_theta"] == [1.0] and fedex.monitor.records[-1]["fedex_entropy"] == 0.0


def test_a_single_candidate_of_local_steps_and_momentum_is_the_plain_course():
    plain, _ = _run(**{"train.local_steps": 2, "train.optimizer.momentum": 0.5})
    fedex, _ = _run(**{"fedex.candidates": [{"train.local_steps": 2, "train.optimizer.momentum": 0.5}]})
    _same_course(plain, fedex)


def test_fedex_settles_on_the_good_learning_rate():
    cands = [{"train.optimizer.lr": 0.001}, {"train.optimizer.lr": 0.5}, {"train.optimizer.lr": 50.0}]
    course, summary = _run(**{"fedex.candidates": cands, "federate.total_round_num": 8})
    assert summary["fedex_best"] == {"train.optimizer.lr": 0.5} and summary["fedex_theta"][1] > 0.99
    assert [r["fedex_mle_arm"] for r in course.monitor.records][-1] == 1


def test_fedex_inside_an_asynchronous_course():
    cands = [{"train.optimizer.lr": 0.001}, {"train.optimizer.lr": 0.5}]
    course, summary = _run(**{"fedex.candidates": cands, "asyn.use": True, "asyn.min_received_num": 3,
                              "federate.sample_client_num": 4, "federate.total_round_num": 6})
    assert summary["rounds"] == 6 and summary["fedex_best"] == {"train.optimizer.lr": 0.5}
    assert all(r["num_updates"] == 3 for r in course.monitor.records)


def test_a_resumed_fedex_course_continues_exactly(tmp_path):
    cands = [{"train.optimizer.lr": 0.05}, {"train.optimizer.lr": 0.5}, {"train.optimizer.lr": 5.0}]
    whole, s_whole = _run(tmp_path / "whole", **{"fedex.candidates": cands, "checkpoint.every": 2})
    resumed, s_res = _run(tmp_path / "resumed", **{
        "fedex.candidates": cands, "resume_from": str(tmp_path / "whole/checkpoints/round_2.pt")})
    assert s_res["fedex_theta"] == s_whole["fedex_theta"]
    sa, sb = whole.server.aggregator.global_state, resumed.server.aggregator.global_state
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("candidates, expected", [
    ([], "non-empty list"),
    ([{"train.optimizer.lrr": 0.1}], "not a client-side key"),
    ([{"algorithm.fedprox.mu": 0.1}], "not a client-side key"),
    ([{"train.optimizer.lr": "fast"}], "fedex.candidates[0]: train.optimizer.lr: expected float"),
    ([{"train.local_steps": 0}], "fedex.candidates[0]: train.local_steps"),
])
def test_bad_candidates_are_one_line_config_errors(candidates, expected):
    with pytest.raises(ConfigError) as info:
        small_cfg(**{"fedex.candidates": candidates})
    assert expected in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="LR schedule"):
        small_cfg(**{"fedex.candidates": [{"train.optimizer.lr": 0.1}], "train.scheduler.type": "cosine",
                     "train.scheduler.total_steps": 10})


def test_fedex_under_edge_aggregators_is_refused_in_one_line():
    # edges broadcast their own model (no theta) and forward no feedback: theta would stay uniform
    with pytest.raises(ConfigError, match=r"^fedex.candidates: edge aggregators .* set topology.edges=0$"):
        small_cfg(**{"fedex.candidates": [{"train.optimizer.lr": 0.1}], "topology.edges": 2})
