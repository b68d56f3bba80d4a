"""FedDyn (Algorithm 1) against hand-computed numbers, and its alpha check."""
import numpy as np
import pytest

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests import drift_problem as P
from tests.conftest import small_cfg

SCHEDULE = {1: (1, 2), 2: (2, 3)}
ALPHA = 0.4


def _reference():
    theta, h = P.THETA0.copy(), np.zeros(3)
    g = {k: np.zeros(3) for k in (1, 2, 3)}
    sent = {}
    for r, clients in SCHEDULE.items():
        local = {}
        for k in clients:
            w = theta.copy()
            for _ in range(P.STEPS):
                w = w - P.LR * (P.grad(k, w) - g[k] + ALPHA * (w - theta))
            g[k] = g[k] - ALPHA * (w - theta)
            local[k] = w
        h = h - ALPHA * sum(local[k] - theta for k in clients) / 3
        theta = sum(local.values()) / len(clients) - h / ALPHA
        sent[r] = local
    return theta, h, g, sent


def test_feddyn_two_rounds_match_hand_computation():
    trainer, agg = P.build(P.config("feddyn", algorithm__feddyn__alpha=ALPHA))
    theta, h, g, sent = _reference()
    for r, clients in SCHEDULE.items():
        results = P.run_round(trainer, agg, r, clients)
        for k in clients:
            assert set(results[k].content) == {"model", "num_samples"}
            np.testing.assert_allclose(P.as_theta(results[k].content["model"]), sent[r][k], atol=1e-6)
    np.testing.assert_allclose(P.as_theta(agg.global_state), theta, atol=1e-6)
    np.testing.assert_allclose(P.as_theta(agg.h), h, atol=1e-6)
    for k in (1, 2, 3):
        np.testing.assert_allclose(P.as_theta(trainer.store.load(k)["g"]), g[k], atol=1e-6)
    assert np.abs(g[2]).max() > 1e-3 and np.abs(h).max() > 1e-3


def test_alpha_must_be_positive():
    with pytest.raises(ConfigError, match="algorithm.feddyn.alpha"):
        small_cfg(None, algorithm__name="feddyn", algorithm__feddyn__alpha=0)


def test_feddyn_course_runs(tmp_path):
    summary = Course(small_cfg(tmp_path, algorithm__name="feddyn", algorithm__feddyn__alpha=0.1)).run()
    assert summary["rounds"] == 2 and summary["final_test_acc"] is not None


def test_feddyn_under_asynchronous_aggregation_is_refused_at_config_time():
    import pytest
    from fedcore.kernel.errors import ConfigError
    from tests.conftest import small_cfg
    with pytest.raises(ConfigError, match="asyn.use: algorithm feddyn is synchronous"):
        small_cfg(algorithm__name="feddyn", asyn__use=True, asyn__min_received_num=2)
    small_cfg(algorithm__name="feddyn", asyn__overselection=True)  # synchronous rounds stay allowed
