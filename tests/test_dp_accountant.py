"""The RDP accountant against published reference values and closed forms."""
import math
import warnings

import pytest

from fedcore.algorithms.dp_accountant import (DEFAULT_ORDERS, RdpAccountant, _log_a_int,
                                              _log_a_numeric, dp_epsilon, rdp_sampled_gaussian,
                                              rdp_to_dp)


def test_dp_sgd_mnist_reference_values():
    """DP-SGD on MNIST (N = 60000, batch 256, 60 epochs, delta = 1e-5), classic RDP conversion:

    - sigma = 1.12 -> epsilon 2.92: the example in TensorFlow Privacy's
      `compute_dp_sgd_privacy` documentation ("satisfies (2.92, 1e-5)-DP");
    - sigma = 1.1 -> epsilon 3.01: TensorFlow Privacy's MNIST tutorial table.
    Steps = ceil(60 * 60000 / 256) = 14063, q = 256 / 60000.
    """
    q, steps = 256 / 60000, math.ceil(60 * 60000 / 256)
    assert steps == 14063
    assert dp_epsilon(q, 1.12, steps, 1e-5, conversion="classic") == pytest.approx(2.92, abs=0.005)
    assert dp_epsilon(q, 1.1, steps, 1e-5, conversion="classic") == pytest.approx(3.01, abs=0.005)


def test_moments_accountant_reference_value():
    """Abadi et al. (2016), Sec. 3.1: q = 0.01, sigma = 4, delta = 1e-5, T = 10000 steps gives
    epsilon ~ 1.26 with the moments accountant (integer moments)."""
    orders = list(range(2, 33))
    eps, order = rdp_to_dp(orders, rdp_sampled_gaussian(0.01, 4.0, 10000, orders), 1e-5, "classic")
    assert eps == pytest.approx(1.26, abs=0.005)


def test_improved_conversion_is_tighter():
    q, steps = 256 / 60000, 14063
    classic = dp_epsilon(q, 1.1, steps, 1e-5, conversion="classic")
    improved = dp_epsilon(q, 1.1, steps, 1e-5)
    assert 0 < improved < classic


def test_no_subsampling_is_the_gaussian_mechanism():
    # q = 1: RDP(alpha) = alpha / (2 sigma^2) per step, exactly.
    rdp = rdp_sampled_gaussian(1.0, 2.0, 3, [2, 4.5, 10])
    assert list(rdp) == pytest.approx([3 * 2 / 8, 3 * 4.5 / 8, 3 * 10 / 8])
    # and the integer binomial formula agrees at q close to 1
    assert _log_a_int(1 - 1e-12, 2.0, 4) / 3 == pytest.approx(4 / 8, rel=1e-6)


def test_alpha_two_closed_form():
    # A_2 = (1-q)^2 + 2q(1-q) + q^2 e^{1/sigma^2} = 1 + q^2 (e^{1/sigma^2} - 1)
    q, s = 0.1, 1.5
    expected = math.log(1 + q * q * (math.exp(1 / s ** 2) - 1))
    assert _log_a_int(q, s, 2) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("alpha", [2, 7, 16])
def test_numeric_integral_matches_binomial_formula(alpha):
    assert _log_a_numeric(0.02, 1.3, alpha) == pytest.approx(_log_a_int(0.02, 1.3, alpha), rel=1e-6)


def test_accountant_composes_steps():
    acc = RdpAccountant()
    acc.step(0.01, 1.0, 50)
    acc.step(0.01, 1.0, 50)
    assert acc.steps == 100
    assert acc.epsilon(1e-5) == pytest.approx(dp_epsilon(0.01, 1.0, 100, 1e-5))
    assert RdpAccountant().epsilon(1e-5) == 0.0


def test_more_noise_less_epsilon():
    assert dp_epsilon(0.01, 2.0, 1000, 1e-5) < dp_epsilon(0.01, 1.0, 1000, 1e-5)
    assert len(DEFAULT_ORDERS) == len(set(DEFAULT_ORDERS))


@pytest.mark.parametrize("q, sigma, steps", [
    (0.5, 1.0, 3),              # a course's central DP: 3 of 6 clients per round (Poisson)
    (2 / 3, 5.0, 1),            # the deployment test's 2 of 3 clients
    (0.01, 1.1, 1000), (0.3, 0.7, 40), (256 / 60000, 1.1, 14063), (1.0, 2.0, 5)])
def test_epsilon_equals_opacus_rdp_analysis(q, sigma, steps):
    """An independent implementation of the same bound: Opacus's RDP analysis of the
    Poisson-subsampled Gaussian (the sampling central DP does), at the same orders, with the
    same conversion (Balle et al. 2020)."""
    rdp = pytest.importorskip("opacus.accountants.analysis.rdp",
                              reason="opacus (test-only, in the dev extra) is not installed")
    orders = list(DEFAULT_ORDERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Opacus warns when the best order is at an end of the list
        theirs, _ = rdp.get_privacy_spent(
            orders=orders, rdp=rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders),
            delta=1e-5)
    assert dp_epsilon(q, sigma, steps, 1e-5) == pytest.approx(float(theirs), rel=1e-6)
