"""FedAsync's worker (Algorithm 1's regularised local problem) and server mix, by hand."""
import numpy as np
import pytest
import torch

from fedcore.kernel.contract import Trainer
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.state import MemoryStateStore
from tests import drift_problem as P
from tests.conftest import small_cfg

RHO, ALPHA = 0.7, 0.4


def _reference(rho: float, clients=(1, 2)):
    """Each worker from x_tau = THETA0: x <- x - lr (grad f_k(x) + rho (x - x_tau)); the server
    then mixes the models in, one after the other (client-id order, fresh: s = 1)."""
    theta = P.THETA0.copy()
    local = {}
    for k in clients:
        x = P.THETA0.copy()
        for _ in range(P.STEPS):
            x = x - P.LR * (P.grad(k, x) + rho * (x - P.THETA0))
        local[k] = x
        theta = (1 - ALPHA) * theta + ALPHA * x
    return theta, local


def test_a_fedasync_round_matches_the_papers_equations_by_hand():
    cfg = P.config("fedasync", algorithm__fedasync__rho=RHO, algorithm__fedasync__alpha=ALPHA)
    trainer, agg = P.build(cfg)
    results = P.run_round(trainer, agg, 1, (1, 2))
    theta, local = _reference(RHO)
    for k in (1, 2):
        np.testing.assert_allclose(P.as_theta(results[k].content["model"]), local[k], rtol=0, atol=1e-12)
    np.testing.assert_allclose(P.as_theta(agg.global_state), theta, rtol=0, atol=1e-12)
    # the regulariser moves the workers (a missing term would pass unnoticed otherwise)
    assert np.abs(_reference(0.0)[0] - theta).max() > 1e-3


def test_rho_zero_is_plain_local_sgd_bit_for_bit():
    cfg = P.config("fedasync", algorithm__fedasync__rho=0.0)
    trainer, agg = P.build(cfg)
    plain = Trainer(P.linear_model(), cfg, MemoryStateStore())
    received = agg.broadcast(1)
    for k in (1, 2, 3):
        a = trainer.fit(k, P.client_data(k), received, 1).content["model"]
        b = plain.fit(k, P.client_data(k), received, 1).content["model"]
        assert all(torch.equal(a[n], b[n]) for n in b)


def test_a_negative_rho_is_refused():
    with pytest.raises(ConfigError, match="algorithm.fedasync.rho"):
        small_cfg(None, algorithm__name="fedasync", algorithm__fedasync__rho=-0.1)
