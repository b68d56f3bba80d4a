"""pFedMe against hand-computed steps on the linear-regression federation, and its limits."""
import numpy as np
import pytest
import torch

from fedcore.algorithms.pfedme import PERSONAL
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests import drift_problem as P
from tests.conftest import small_cfg

LAM, K, PLR = 2.0, 2, 0.1


def _cfg(**kw):
    base = dict(algorithm__pfedme__lambda=LAM, algorithm__pfedme__inner_steps=K,
                algorithm__pfedme__personal_lr=PLR)
    return P.config("pfedme", **{**base, **kw})


def _reference(rounds, beta=1.0, k_steps=K, local_steps=P.STEPS):
    """Algorithm 1 of the paper, full-batch: R local steps of (K inner steps on theta, one step
    of w toward theta); the server mixes the plain average in with beta."""
    theta_glob, personal = P.THETA0.copy(), {}
    for clients in rounds:
        local = {}
        for k in clients:
            w = theta_glob.copy()
            th = w.copy()                   # the inner solver starts at w_t, then carries over
            for _ in range(local_steps):
                for _ in range(k_steps):
                    th = th - PLR * (P.grad(k, th) + LAM * (th - w))
                w = w - P.LR * LAM * (w - th)
            local[k], personal[k] = w, th
        avg = sum(local[k] for k in clients) / len(clients)
        theta_glob = (1 - beta) * theta_glob + beta * avg
    return theta_glob, personal


@pytest.mark.parametrize("beta", [1.0, 1.5])
def test_pfedme_two_rounds_match_hand_computation(beta):
    trainer, agg = P.build(_cfg(algorithm__pfedme__beta=beta))
    rounds = [(1, 2, 3), (1, 3)]
    for r, clients in enumerate(rounds, 1):
        results = P.run_round(trainer, agg, r, clients)
        for k, res in results.items():
            assert set(res.content) == {"model", "num_samples"}
            assert res.work == P.STEPS * K * P.n_samples(k)      # K gradients per local step
    theta, personal = _reference(rounds, beta)
    np.testing.assert_allclose(P.as_theta(agg.global_state), theta, rtol=0, atol=1e-12)
    for k in (1, 2, 3):     # client 2's theta is the one of its last round, the first
        np.testing.assert_allclose(P.as_theta(trainer.store.load(k)[PERSONAL]), personal[k],
                                   rtol=0, atol=1e-12)
    # the test would notice the inner solver restarted at w each local step
    restarted = P.THETA0.copy()
    for _ in range(P.STEPS):
        th = restarted.copy()
        for _ in range(K):
            th = th - PLR * (P.grad(1, th) + LAM * (th - restarted))
        restarted = restarted - P.LR * LAM * (restarted - th)
    assert np.abs(restarted - _reference([(1,)])[0]).max() > 1e-4


def test_one_inner_and_one_local_step_with_beta_one_is_a_gradient_step():
    # K = R = 1, beta = 1: theta = w - p grad f(w), so w - eta lambda (w - theta) is one SGD step
    # of rate eta lambda p, and the server takes the plain average of those.
    trainer, agg = P.build(_cfg(algorithm__pfedme__inner_steps=1, train__local_steps=1))
    P.run_round(trainer, agg, 1, (1, 2, 3))
    expected = np.mean([P.THETA0 - P.LR * LAM * PLR * P.grad(k, P.THETA0) for k in (1, 2, 3)], axis=0)
    np.testing.assert_allclose(P.as_theta(agg.global_state), expected, rtol=0, atol=1e-12)


def test_the_limit_course_equals_fedavg_with_the_product_rate(tmp_path):
    # the same limit through whole courses: FedAvg with one local step at rate eta lambda p
    # (every client holds as many samples, so the plain average is FedAvg's weighted one)
    common = dict(model__type="mlp", model__hidden=[6], model__dtype="float64",
                  train__local_steps=1, federate__total_round_num=3, federate__sample_client_num=4)
    a = Course(small_cfg(tmp_path / "a", algorithm__name="pfedme", algorithm__pfedme__lambda=4.0,
                         algorithm__pfedme__inner_steps=1, algorithm__pfedme__personal_lr=0.5,
                         train__optimizer__lr=0.05, **common))
    b = Course(small_cfg(tmp_path / "b", algorithm__name="fedavg", train__optimizer__lr=0.1, **common))
    a.run(), b.run()
    assert len({len(c.data.train) for c in a.clients.values()}) == 1
    ma = torch.load(tmp_path / "a" / "final_model.pt", weights_only=True)
    mb = torch.load(tmp_path / "b" / "final_model.pt", weights_only=True)
    assert max((ma[k] - mb[k]).abs().max().item() for k in mb) < 1e-12


def test_a_client_is_evaluated_with_its_personal_model():
    trainer, agg = P.build(_cfg())
    a, y = P.arrays(1)
    before = trainer.evaluate(1, P.client_data(1), agg.broadcast(1))     # no theta yet: the global
    assert before["loss"] == pytest.approx(np.mean((a @ P.THETA0 - y) ** 2), abs=1e-12)
    P.run_round(trainer, agg, 1, (1, 2, 3))
    _, personal = _reference([(1, 2, 3)])
    got = trainer.evaluate(1, P.client_data(1), agg.broadcast(2))
    assert got["loss"] == pytest.approx(np.mean((a @ personal[1] - y) ** 2), abs=1e-12)


@pytest.mark.parametrize("optimizer", [dict(train__optimizer__momentum=0.9),
                                       dict(train__optimizer__type="adam")])
def test_pfedme_refuses_an_optimizer_it_would_ignore(optimizer):
    with pytest.raises(ConfigError, match="pfedme takes its own plain gradient steps"):
        small_cfg(None, algorithm__name="pfedme", **optimizer)


def test_pfedme_refuses_micro_batches():
    with pytest.raises(ConfigError, match="train.grad_accum_steps: algorithm pfedme defines its own"):
        small_cfg(None, algorithm__name="pfedme", train__grad_accum_steps=2)
