"""FedProx against hand-computed numbers, its FedAvg limit, and stragglers."""
import numpy as np
import torch

from fedcore.kernel.contract import Trainer
from fedcore.runtime.course import Course
from fedcore.algorithms.fedprox import straggler_steps
from tests import drift_problem as P
from tests.conftest import small_cfg


def _reference(mu: float, rounds: int, clients=(1, 2, 3)):
    theta = P.THETA0.copy()
    for _ in range(rounds):
        local = {}
        for k in clients:
            w = theta.copy()
            for _ in range(P.STEPS):
                w = w - P.LR * (P.grad(k, w) + mu * (w - theta))
            local[k] = w
        n = np.array([P.n_samples(k) for k in clients], dtype=float)
        theta = sum(n[i] * local[k] for i, k in enumerate(clients)) / n.sum()
    return theta, local


def test_fedprox_two_rounds_match_hand_computation():
    cfg = P.config("fedprox", algorithm__fedprox__mu=0.7)
    trainer, agg = P.build(cfg)
    for r in (1, 2):
        results = P.run_round(trainer, agg, r, (1, 2, 3))
    theta, local = _reference(0.7, 2)
    np.testing.assert_allclose(P.as_theta(agg.global_state), theta, rtol=0, atol=1e-6)
    for k in (1, 2, 3):
        np.testing.assert_allclose(P.as_theta(results[k].content["model"]), local[k], atol=1e-6)
        assert results[k].content["num_samples"] == P.n_samples(k)
        assert set(results[k].content) == {"model", "num_samples"}
    # the proximal term changes the result (the test would not notice a missing term otherwise)
    assert np.abs(_reference(0.0, 2)[0] - theta).max() > 1e-3


def test_proximal_gradient_is_finite_at_the_anchor():
    cfg = P.config("fedprox", algorithm__fedprox__mu=1.0, train__local_steps=1)
    trainer, agg = P.build(cfg)
    P.run_round(trainer, agg, 1, (1,))
    assert torch.isfinite(agg.global_state["1.weight"]).all()
    np.testing.assert_allclose(P.as_theta(agg.global_state), P.THETA0 - P.LR * P.grad(1, P.THETA0),
                               atol=1e-12)


def test_mu_zero_is_fedavg_exactly(tmp_path):
    a = Course(small_cfg(tmp_path / "a", algorithm__name="fedprox", algorithm__fedprox__mu=0.0)).run()
    b = Course(small_cfg(tmp_path / "b", algorithm__name="fedavg")).run()
    ma = torch.load(tmp_path / "a" / "final_model.pt", weights_only=True)
    mb = torch.load(tmp_path / "b" / "final_model.pt", weights_only=True)
    assert all(torch.equal(ma[k], mb[k]) for k in mb)
    assert a["virtual_time"] == b["virtual_time"] and a["bytes_up"] == b["bytes_up"]


def test_straggler_draws():
    full = [straggler_steps(0, r, k, 1.0, 3, 2, 6) for r in range(1, 6) for k in range(1, 6)]
    assert set(full) <= {2, 4, 6} and len(set(full)) > 1          # whole epochs in [1, E]
    steps = [straggler_steps(0, r, k, 1.0, None, 2, 5) for r in range(1, 6) for k in range(1, 6)]
    assert set(steps) <= {1, 2, 3, 4, 5} and len(set(steps)) > 1    # steps in [1, K]
    assert all(straggler_steps(0, r, 1, 0.0, 3, 2, 6) == 6 for r in range(1, 6))
    some = [straggler_steps(0, r, k, 0.5, 3, 2, 6) for r in range(1, 21) for k in range(1, 6)]
    assert 0 < sum(s < 6 for s in some) < len(some)


def test_a_straggler_accumulating_batches_takes_fewer_steps_not_more():
    # 24 samples at batch 10: 3 batches an epoch; 3 epochs with grad_accum_steps 3 are 3 optimizer
    # steps. A straggler trains e in [1, 3] epochs: 3e batches, e steps (it took 3e steps before).
    cfg = small_cfg(None, algorithm__name="fedprox", algorithm__fedprox__straggler_fraction=1.0,
                    train__local_epochs=3, train__grad_accum_steps=3, train__batch_size=10)
    trainer, _ = P.build(cfg)
    assert Trainer.num_steps(trainer, 24) == 3
    steps = []
    for r in range(1, 8):
        for k in range(1, 6):
            trainer._round, trainer._client = r, k
            steps.append(trainer.num_steps(24))
    assert set(steps) == {1, 2, 3}


def test_stragglers_train_fewer_epochs_and_are_still_aggregated():
    cfg = P.config("fedprox", algorithm__fedprox__straggler_fraction=1.0, train__batch_size=2,
                   train__local_steps=None, train__local_epochs=3)
    trainer, agg = P.build(cfg)
    seen = set()
    for r in (1, 2, 3):
        results = P.run_round(trainer, agg, r, (1, 2, 3))
        models = [P.as_theta(results[k].content["model"]) for k in (1, 2, 3)]
        n = np.array([P.n_samples(k) for k in (1, 2, 3)], dtype=float)
        np.testing.assert_allclose(P.as_theta(agg.global_state),
                                   sum(n[i] * models[i] for i in range(3)) / n.sum(), atol=1e-12)
        for k, res in results.items():
            epochs = res.work / P.n_samples(k)     # each epoch passes every sample once
            assert epochs in (1.0, 2.0, 3.0)
            seen.add(epochs)
    assert len(seen) > 1
