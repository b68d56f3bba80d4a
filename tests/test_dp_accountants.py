"""PLD and PRV accounting (privacy.dp.accountant) against independent computations: the
analytic Gaussian mechanism, dp-accounting's own RDP and PLD accountants, and our RDP."""
import json
import math

import pytest

pytest.importorskip("dp_accounting", reason="needs the privacy extra (pip install 'fedcore[privacy]')")
pytest.importorskip("prv_accountant", reason="needs the privacy extra (pip install 'fedcore[privacy]')")

import dp_accounting  # noqa: E402
from dp_accounting import pld, rdp  # noqa: E402
from scipy.optimize import brentq  # noqa: E402
from scipy.stats import norm  # noqa: E402

from fedcore.algorithms.dp_accountant import DEFAULT_ORDERS, dp_epsilon  # noqa: E402
from fedcore.algorithms.dp_accountants import calibrate_sigma, epsilon_for, make_accountant  # noqa: E402
from fedcore.kernel.errors import ConfigError  # noqa: E402
from fedcore.runtime.course import Course  # noqa: E402
from tests.conftest import small_cfg  # noqa: E402
from tests.deploy_helpers import run_fedcore  # noqa: E402


INTEGER_ORDERS = [a for a in DEFAULT_ORDERS if float(a).is_integer()]


def _analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of a Gaussian mechanism of sensitivity/std mu (Balle and Wang 2018):
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), solved for eps."""
    gap = lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta  # noqa: E731
    return brentq(gap, 0.0, 100.0)


@pytest.mark.parametrize("sigma, steps", [(1.0, 1), (2.0, 3), (4.0, 10)])
def test_pld_and_prv_match_the_exact_gaussian_mechanism(sigma, steps):
    # q = 1: `steps` Gaussians of multiplier sigma compose exactly to one of sigma / sqrt(steps)
    exact = _analytic_gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5)
    for kind in ("pld", "prv"):
        eps = epsilon_for(kind, 1.0, sigma, steps, 1e-5)
        assert exact - 1e-6 <= eps <= exact + 0.02, kind   # upper bounds, within their grid/error
    assert epsilon_for("rdp", 1.0, sigma, steps, 1e-5) > exact + 0.01   # RDP's conversion loses


@pytest.mark.parametrize("q, sigma, steps", [(0.01, 1.1, 200), (0.1, 0.8, 20)])
def test_subsampled_pld_is_below_rdp_and_agrees_with_prv_and_the_library(q, sigma, steps):
    ours_pld = epsilon_for("pld", q, sigma, steps, 1e-5)
    ours_prv = epsilon_for("prv", q, sigma, steps, 1e-5)
    ours_rdp = epsilon_for("rdp", q, sigma, steps, 1e-5)
    assert ours_pld < ours_rdp and ours_prv < ours_rdp
    assert ours_pld == pytest.approx(ours_prv, abs=0.03)          # two libraries, two methods
    # dp-accounting's RDP accountant for the same mechanism and orders equals ours (integer
    # orders: the library's series for fractional ones does not converge at q = 0.5)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    lib = rdp.RdpAccountant(orders=INTEGER_ORDERS)
    lib.compose(event, steps)
    assert lib.get_epsilon(1e-5) == pytest.approx(dp_epsilon(q, sigma, steps, 1e-5, INTEGER_ORDERS), rel=1e-9)
    # and its PLD at the library's finest default grid is at most ours (coarser, pessimistic)
    fine = pld.PLDAccountant(value_discretization_interval=1e-4)
    fine.compose(event, steps)
    assert fine.get_epsilon(1e-5) <= ours_pld + 1e-9 and ours_pld - fine.get_epsilon(1e-5) < 0.01


def test_an_accountant_composes_across_calls_and_survives_its_state():
    for kind in ("pld", "prv"):
        a = make_accountant(kind)
        a.step(0.5, 1.0)
        a.step(0.5, 1.0, 2)
        b = make_accountant(kind)
        b.restore(a.state())
        assert a.steps == b.steps == 3 and a.state() == {"segments": [[0.5, 1.0, 3]]}
        assert a.epsilon(1e-5) == pytest.approx(b.epsilon(1e-5), rel=1e-9)
        assert a.epsilon(1e-5) == pytest.approx(epsilon_for(kind, 0.5, 1.0, 3, 1e-5), rel=1e-9)


def _records(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_a_course_reports_the_pld_epsilon_the_library_computes(tmp_path):
    summary = Course(small_cfg(tmp_path, privacy__dp__mode="central", privacy__dp__accountant="pld",
                               privacy__dp__noise_multiplier=1.5, federate__sample_client_num=3,
                               federate__total_round_num=3, eval__clients=False)).run()
    expected = []
    for t in (1, 2, 3):   # q = 3/6, sigma 1.5, built here with the library directly
        lib = pld.PLDAccountant(value_discretization_interval=1e-3)
        lib.compose(dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.5)), t)
        expected.append(lib.get_epsilon(1e-5))
    assert [r["dp_epsilon"] for r in _records(tmp_path)] == pytest.approx(expected, rel=1e-9)
    assert summary["dp_accountant"] == "pld" and summary["dp_epsilon"] == pytest.approx(expected[-1])
    assert expected[-1] < dp_epsilon(0.5, 1.5, 3, 1e-5)          # tighter than RDP's


def test_a_target_epsilon_sets_the_least_noise_that_meets_it():
    cfg = small_cfg(privacy__dp__mode="central", privacy__dp__target_epsilon=2.0,
                    federate__sample_client_num=3, federate__total_round_num=5)
    sigma = cfg["privacy.dp.noise_multiplier"]
    # checked with dp-accounting's RDP (the same analysis as ours, another implementation, on
    # the integer orders: a bound at most a little looser than ours on all orders)
    assert dp_epsilon(0.5, sigma, 5, 1e-5) <= 2.0 < dp_epsilon(0.5, sigma * (1 - 3e-3), 5, 1e-5)
    assert _library_rdp(0.5, sigma, 5) == pytest.approx(dp_epsilon(0.5, sigma, 5, 1e-5, INTEGER_ORDERS), rel=1e-9)
    assert calibrate_sigma("pld", 0.5, 5, 1e-5, 2.0) < sigma      # PLD needs less noise


def _library_rdp(q, sigma, steps):
    lib = rdp.RdpAccountant(orders=INTEGER_ORDERS)
    lib.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return lib.get_epsilon(1e-5)


@pytest.mark.parametrize("overrides, match", [
    (dict(privacy__dp__target_epsilon=1e-9), "privacy.dp.target_epsilon: epsilon 1e-09 at delta 1e-05 cannot be met"),
    (dict(privacy__dp__target_epsilon=1.0, privacy__dp__mode="local"), "privacy.dp.target_epsilon: a local"),
])
def test_targets_that_cannot_be_met_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        small_cfg(**{"privacy__dp__mode": "central", **overrides})


@pytest.mark.parametrize("override, key", [("privacy.dp.accountant=moments", "privacy.dp.accountant"),
                                           ("privacy.dp.target_epsilon=1e-9", "privacy.dp.target_epsilon")])
def test_bad_accounting_input_exits_2_with_one_line(tmp_path, override, key):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("federate: {client_num: 4, total_round_num: 2}\ndata: {type: synthetic}\n"
                   "privacy: {dp: {mode: central}}\n")
    r = run_fedcore(["--cfg", cfg, override, f"outdir={tmp_path / 'out'}"], timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and key in r.stderr, r.stderr


@pytest.mark.parametrize("q, sigma, delta", [(1.0, math.sqrt(3), 0.126936), (0.2, 0.5, 0.15594)])
def test_the_libraries_own_examples(q, sigma, delta):
    # dp-accounting's pld_privacy_accountant_test (test_gaussian_basic,
    # test_poisson_subsampled_gaussian): three steps spend epsilon 1 at these deltas
    for kind in ("pld", "prv"):
        acc = make_accountant(kind)
        acc.step(q, sigma)
        acc.step(q, sigma, 2)
        assert acc.epsilon(delta) == pytest.approx(1.0, abs=0.02), kind
