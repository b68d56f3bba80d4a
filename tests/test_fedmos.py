"""FedMoS: full-batch numbers, the double momentum on fixed mini-batches vs SGD, its limits, work."""
import numpy as np
import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests import drift_problem as P
from tests.conftest import small_cfg

A, MU = 0.3, 0.05


def test_full_batch_two_rounds_match_hand_computation():
    # full batch: d_t = grad f(w_t) by induction, so the local step is w - eta g - mu (w - w_g)
    trainer, agg = P.build(P.config("fedmos", algorithm__fedmos__a=A, algorithm__fedmos__mu=MU))
    theta = P.THETA0.copy()
    for r in (1, 2):
        results = P.run_round(trainer, agg, r, (1, 2, 3))
        local = {}
        for k in (1, 2, 3):
            w = theta.copy()
            for _ in range(P.STEPS):
                w = w - P.LR * P.grad(k, w) - MU * (w - theta)
            local[k] = w
            np.testing.assert_allclose(P.as_theta(results[k].content["model"]), w, atol=1e-6)
            assert results[k].work == P.n_samples(k) * (2 * P.STEPS - 1)   # 2 gradients after step 1
            assert "fedmos" not in trainer.store.load(k)                   # buffers end with the round
        n = np.array([P.n_samples(k) for k in (1, 2, 3)], dtype=float)
        theta = sum(n[i] * local[k] for i, k in enumerate((1, 2, 3))) / n.sum()
    np.testing.assert_allclose(P.as_theta(agg.global_state), theta, atol=1e-6)


def _batch_grad(theta, a, y):
    return 2.0 / len(y) * a.T @ (a @ theta - y)


def test_double_momentum_on_fixed_mini_batches_differs_from_sgd():
    a_all, y_all = P.arrays(2)
    batches = [[0, 1], [2, 3], [4, 0], [1, 3]]
    trainer, _ = P.build(P.config("fedmos", algorithm__fedmos__a=A, algorithm__fedmos__mu=MU))
    received = {"model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}
    state: dict = {}
    trainer.begin(state, received)
    x_t = torch.tensor([[p for p in row[:2]] for row in a_all], dtype=torch.float64)
    y_t = torch.tensor(y_all)
    w, w_g, w_prev, d = P.THETA0.copy(), P.THETA0.copy(), None, None
    w_sgd = P.THETA0.copy()
    works = []
    for t, b in enumerate(batches):
        _, work = trainer.step(x_t[b], y_t[b])
        works.append(work)
        g = _batch_grad(w, a_all[b], y_all[b])
        d = g if t == 0 else g + (1 - A) * (d - _batch_grad(w_prev, a_all[b], y_all[b]))
        w_prev, w = w, w - P.LR * d - MU * (w - w_g)
        w_sgd = w_sgd - P.LR * _batch_grad(w_sgd, a_all[b], y_all[b]) - MU * (w_sgd - w_g)
        np.testing.assert_allclose(P.as_theta(trainer.model.state_dict()), w, atol=1e-6)
        np.testing.assert_allclose(np.concatenate([t_.reshape(-1).numpy() for t_ in state["fedmos"]["d"]]),
                                   d, atol=1e-6)
    assert works == [2.0, 4.0, 4.0, 4.0]
    assert np.abs(w - w_sgd).max() > 1e-3          # the momentum really acts


def test_a_one_mu_zero_is_fedavg_exactly(tmp_path):
    a = Course(small_cfg(tmp_path / "m", algorithm__name="fedmos", algorithm__fedmos__a=1.0,
                         algorithm__fedmos__mu=0.0)).run()
    b = Course(small_cfg(tmp_path / "f", algorithm__name="fedavg")).run()
    mm = torch.load(tmp_path / "m" / "final_model.pt", weights_only=True)
    mf = torch.load(tmp_path / "f" / "final_model.pt", weights_only=True)
    assert all(torch.equal(mm[k], mf[k]) for k in mf)
    assert a["virtual_time"] == b["virtual_time"]


def test_server_momentum_is_heavy_ball_on_the_averaged_delta():
    beta = 0.5
    trainer, agg = P.build(P.config("fedmos", algorithm__fedmos__a=1.0, algorithm__fedmos__mu=0.0,
                                    algorithm__fedmos__server_momentum=beta))
    theta, m = P.THETA0.copy(), np.zeros(3)
    for r in (1, 2):
        results = P.run_round(trainer, agg, r, (1, 2))
        avg = sum(P.n_samples(k) * P.as_theta(results[k].content["model"]) for k in (1, 2)) / 9
        m = beta * m + (avg - theta)
        theta = theta + m
    np.testing.assert_allclose(P.as_theta(agg.global_state), theta, atol=1e-9)


def test_optimizer_must_be_plain_sgd():
    with pytest.raises(ConfigError, match="train.optimizer"):
        small_cfg(None, algorithm__name="fedmos", train__optimizer__momentum=0.9)


def test_a_one_mu_zero_is_fedavg_under_an_lr_schedule_too(tmp_path):
    # the step size is the scheduled one, as for every other trainer
    sched = dict(train__scheduler__type="cosine", train__scheduler__warmup_steps=2,
                 train__scheduler__total_steps=8, train__preserve_optimizer_state=True)
    Course(small_cfg(tmp_path / "m", algorithm__name="fedmos", algorithm__fedmos__a=1.0,
                     algorithm__fedmos__mu=0.0, **sched)).run()
    Course(small_cfg(tmp_path / "f", algorithm__name="fedavg", **sched)).run()
    mm = torch.load(tmp_path / "m" / "final_model.pt", weights_only=True)
    mf = torch.load(tmp_path / "f" / "final_model.pt", weights_only=True)
    assert all(torch.allclose(mm[k], mf[k], atol=1e-7) for k in mf)


def _three_fedmos_steps(layer, batch_size: int, samples: int, watch):
    """A FedMoS fit of 3 steps (a = 0.5) of Linear -> `layer` -> ReLU -> Linear, float64,
    on `samples` seeded points in batches of `batch_size`, with `watch(module)` hooked on the
    middle layer first; returns the trainer."""
    from torch import nn

    from fedcore.algorithms.fedmos import FedMoSTrainer
    from fedcore.kernel.state import MemoryStateStore
    from fedcore.scenarios.data import ClientData, Split

    torch.manual_seed(0)
    width = layer.num_features if hasattr(layer, "num_features") else 16
    model = nn.Sequential(nn.Linear(3, width), layer, nn.ReLU(), nn.Linear(width, 2)).double()
    cfg = small_cfg(None, algorithm__name="fedmos", model__dtype="float64", train__local_steps=3,
                    train__batch_size=batch_size, algorithm__fedmos__a=0.5)
    trainer = FedMoSTrainer(model, cfg, MemoryStateStore())
    watch(trainer.model[1])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (samples,), generator=g)
    data = ClientData(Split(x, y), Split(x[:0], y[:0]), Split(x[:0], y[:0]))
    trainer.fit(1, data, {"model": {k: v.clone() for k, v in model.state_dict().items()}}, 1)
    return trainer


def test_the_previous_iterates_pass_leaves_the_running_statistics_alone():
    # A BatchNorm's running mean follows the iterates w_t only: with momentum 0.1 over the batch
    # means that the current-iterate passes feed it (captured by a hook), one update per step;
    # the extra pass at w_{t-1} (steps after the first) updated it too, and counted the batch.
    seen = []
    trainer = _three_fedmos_steps(torch.nn.BatchNorm1d(4), 4, 12, lambda m: m.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].detach().mean(0))))
    assert len(seen) == 5   # step 1: w_0; steps 2 and 3: w_t, then w_{t-1}
    expected = torch.zeros(4, dtype=torch.float64)
    for batch_mean in (seen[0], seen[1], seen[3]):
        expected = 0.9 * expected + 0.1 * batch_mean
    bn = trainer.model[1]
    assert bn.num_batches_tracked.item() == 3
    assert torch.allclose(bn.running_mean, expected, rtol=0, atol=1e-12)


def test_both_gradients_of_a_step_see_the_same_dropout_masks():
    # d_t needs grad f(w_t; xi_t) and grad f(w_{t-1}; xi_t) on the same sample: with dropout, the
    # same masks. A hook records which units each forward pass drops.
    dropped = []
    _three_fedmos_steps(torch.nn.Dropout(0.5), 6, 6, lambda m: m.register_forward_hook(
        lambda _m, args, out: dropped.append((out == 0) & (args[0] != 0))))
    assert len(dropped) == 5   # step 1: w_0; steps 2 and 3: w_t, then w_{t-1}
    assert torch.equal(dropped[1], dropped[2]) and torch.equal(dropped[3], dropped[4])
    assert not torch.equal(dropped[0], dropped[1]) and dropped[1].any()   # each step draws anew
