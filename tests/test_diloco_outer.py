"""DiLoCo's server side: outer-gradient sign, weighting, FedAvg equivalence, momentum and
Nesterov recurrences against hand-computed values, and the parameter/buffer policy."""
import pytest
import torch
from torch import nn

from fedcore.kernel.contract import ReceivedUpdate
from fedcore.algorithms.diloco import DiLoCoAggregator
from fedcore.algorithms.fedavg import FedAvgAggregator
from tests.conftest import small_cfg

D = torch.float64


class Tiny(nn.Module):
    """A trainable parameter, a frozen parameter, a float buffer and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=D))
        self.frozen = nn.Parameter(torch.tensor([0.5], dtype=D), requires_grad=False)
        self.register_buffer("running", torch.tensor([0.0], dtype=D))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))


def cfg(**diloco):
    keys = {f"algorithm__diloco__{k}": v for k, v in diloco.items()}
    return small_cfg(algorithm__name="diloco", train__local_steps=2,
                     train__optimizer__type="adamw", train__preserve_optimizer_state=True, **keys)


def update(cid, agg, deltas, n, extra=None):
    """Client `cid` returns the current global model plus `deltas` (by entry name)."""
    model = {k: v.clone() for k, v in agg.global_state.items()}
    for name, d in deltas.items():
        model[name] = model[name] + torch.tensor(d, dtype=model[name].dtype)
    model.update(extra or {})
    return ReceivedUpdate(cid, {"model": model, "num_samples": n}, 1, 0)


# client a moves w by [1, 0], client b by [0, 2]; n_a = 1, n_b = 3
DA, DB = {"w": [1.0, 0.0]}, {"w": [0.0, 2.0]}


def round_(agg, r=1, extra_a=None, extra_b=None):
    return agg.aggregate([update(1, agg, DA, 1, extra_a), update(2, agg, DB, 3, extra_b)], r)


def w(agg):
    return agg.global_state["w"]


def test_outer_gradient_is_minus_mean_delta_so_sgd_moves_towards_clients():
    agg = DiLoCoAggregator(Tiny(), cfg(outer_optimizer="sgd", outer_learning_rate=0.5), 2)
    metrics = round_(agg)
    # uniform mean delta [0.5, 1.0]; g = [-0.5, -1.0]; θ - 0.5 g = [1.25, 2.5]
    assert torch.allclose(w(agg), torch.tensor([1.25, 2.5], dtype=D), atol=1e-12)
    assert metrics["outer_grad_norm"] == pytest.approx((0.25 + 1.0) ** 0.5)
    assert metrics["mean_delta_norm"] == pytest.approx((0.25 + 1.0) ** 0.5)


def test_uniform_and_sample_weighting():
    uni = DiLoCoAggregator(Tiny(), cfg(outer_optimizer="sgd", outer_learning_rate=1.0), 2)
    num = DiLoCoAggregator(Tiny(), cfg(outer_optimizer="sgd", outer_learning_rate=1.0,
                                       aggregation_weighting="num_samples"), 2)
    round_(uni)
    round_(num)
    assert torch.allclose(w(uni), torch.tensor([1.5, 3.0], dtype=D), atol=1e-12)     # (1/2, 1/2)
    assert torch.allclose(w(num), torch.tensor([1.25, 3.5], dtype=D), atol=1e-12)    # (1/4, 3/4)


def _random_updates(agg, gen, ns):
    return [ReceivedUpdate(i + 1, {"model": {k: v + torch.randn(v.shape, generator=gen, dtype=v.dtype)
                                             if v.is_floating_point() else v + i
                                             for k, v in agg.global_state.items()},
                                   "num_samples": n}, 1, 0) for i, n in enumerate(ns)]


def test_outer_sgd_lr_one_equals_fedavg_under_matching_weighting():
    c = cfg(outer_optimizer="sgd", outer_learning_rate=1.0, aggregation_weighting="num_samples")
    dil, fed = DiLoCoAggregator(Tiny(), c, 3), FedAvgAggregator(Tiny(), c, 3)
    gen_d, gen_f = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for r in (1, 2, 3):
        dil.aggregate(_random_updates(dil, gen_d, [1, 4, 7]), r)
        fed.aggregate(_random_updates(fed, gen_f, [1, 4, 7]), r)
        for k in fed.global_state:
            assert torch.allclose(dil.global_state[k].double(), fed.global_state[k].double(),
                                  atol=1e-12), k
            assert dil.global_state[k].dtype == fed.global_state[k].dtype


def test_outer_sgd_lr_one_with_uniform_weighting_is_not_sample_weighted_fedavg():
    c = cfg(outer_optimizer="sgd", outer_learning_rate=1.0)  # uniform
    dil, fed = DiLoCoAggregator(Tiny(), c, 2), FedAvgAggregator(Tiny(), c, 2)
    round_(dil)
    round_(fed)
    assert not torch.allclose(w(dil), w(fed))


def test_momentum_recurrence_over_two_rounds():
    agg = DiLoCoAggregator(Tiny(), cfg(outer_optimizer="sgdm", outer_learning_rate=0.7,
                                       outer_momentum=0.9), 2)
    round_(agg, 1)
    # b1 = g1 = [-0.5, -1]; θ1 = θ0 - 0.7 b1 = [1.35, 2.7]
    assert torch.allclose(w(agg), torch.tensor([1.35, 2.7], dtype=D), atol=1e-12)
    round_(agg, 2)
    # b2 = 0.9 b1 + g2 = [-0.95, -1.9]; θ2 = θ1 - 0.7 b2 = [2.015, 4.03]
    assert torch.allclose(w(agg), torch.tensor([2.015, 4.03], dtype=D), atol=1e-12)
    assert torch.allclose(agg.state_dict()["outer_momentum"]["w"],
                          torch.tensor([-0.95, -1.9], dtype=D), atol=1e-12)


def test_nesterov_recurrence_over_three_rounds():
    agg = DiLoCoAggregator(Tiny(), cfg(), 2)  # defaults: nesterov, lr 0.7, momentum 0.9, uniform
    expected = [
        [1.665, 3.33],        # b1 = [-0.5, -1]; step = g1 + 0.9 b1 = [-0.95, -1.9]
        [2.6135, 5.227],      # b2 = [-0.95, -1.9]; step = [-1.355, -2.71]
        [3.81715, 7.6343],    # b3 = [-1.355, -2.71]; step = [-1.7195, -3.439]
    ]
    for r, exp in enumerate(expected, start=1):
        metrics = round_(agg, r)
        assert torch.allclose(w(agg), torch.tensor(exp, dtype=D), atol=1e-12), r
    assert agg.state_dict()["outer_rounds"] == 3
    # the first round's step is (1 + μ) η = 1.33 times FedAvg's
    agg1 = DiLoCoAggregator(Tiny(), cfg(), 2)
    m1 = round_(agg1)
    assert m1["outer_update_norm"] / m1["mean_delta_norm"] == pytest.approx(1.33)
    assert metrics["outer_lr"] == 0.7


def test_recurrences_match_torch_sgd_on_random_deltas():
    for name, kw in (("sgd", {}), ("sgdm", {"momentum": 0.8}),
                     ("nesterov", {"momentum": 0.8, "nesterov": True})):
        agg = DiLoCoAggregator(Tiny(), cfg(outer_optimizer=name, outer_learning_rate=0.3,
                                           outer_momentum=0.8), 3)
        ref = nn.Parameter(agg.global_state["w"].clone())
        opt = torch.optim.SGD([ref], lr=0.3, **kw)
        gen = torch.Generator().manual_seed(1)
        for r in range(1, 5):
            ups = _random_updates(agg, gen, [2, 2, 2])
            mean = sum(u.content["model"]["w"] for u in ups) / 3
            ref.grad = (ref.detach() - mean)
            opt.step()
            agg.aggregate(ups, r)
            assert torch.allclose(w(agg), ref.detach(), atol=1e-12), (name, r)


def test_default_policy_momentum_on_trainable_parameters_only_and_integer_buffer_rounded():
    agg = DiLoCoAggregator(Tiny(), cfg(aggregation_weighting="num_samples"), 2)
    a = {"frozen": torch.tensor([1.5], dtype=D), "running": torch.tensor([2.0], dtype=D),
         "count": torch.tensor(4)}
    b = {"frozen": torch.tensor([0.5], dtype=D), "running": torch.tensor([6.0], dtype=D),
         "count": torch.tensor(7)}
    round_(agg, extra_a=a, extra_b=b)
    g = agg.global_state
    assert torch.allclose(g["frozen"], torch.tensor([0.75], dtype=D))     # 1/4 1.5 + 3/4 0.5
    assert torch.allclose(g["running"], torch.tensor([5.0], dtype=D))     # 1/4 2 + 3/4 6
    assert g["count"].dtype == torch.int64 and g["count"].item() == 6     # 6.25 rounded
    # w: sample-weighted mean delta [0.25, 1.5], Nesterov first step 1.33x
    assert torch.allclose(g["w"], torch.tensor([1 + 1.33 * 0.25, 2 + 1.33 * 1.5], dtype=D))
    assert set(agg.state_dict()["outer_momentum"]) == {"w"}


def test_all_floating_policy_puts_buffers_and_frozen_parameters_under_the_outer_optimizer():
    agg = DiLoCoAggregator(Tiny(), cfg(apply_outer_optimizer_to="all_floating"), 2)
    a = {"running": torch.tensor([2.0], dtype=D), "count": torch.tensor(4)}
    b = {"running": torch.tensor([6.0], dtype=D), "count": torch.tensor(6)}
    round_(agg, extra_a=a, extra_b=b)
    g = agg.global_state
    assert torch.allclose(g["running"], torch.tensor([1.33 * 4.0], dtype=D))   # 0 + 1.33 * 4
    assert torch.allclose(g["frozen"], torch.tensor([0.5], dtype=D))           # zero delta
    assert g["count"].item() == 5                                             # still plain mean
    assert set(agg.state_dict()["outer_momentum"]) == {"w", "frozen", "running"}


def test_broadcast_tensors_are_never_mutated():
    agg = DiLoCoAggregator(Tiny(), cfg(), 2)
    sent = agg.broadcast(1)["model"]
    before = {k: v.clone() for k, v in sent.items()}
    round_(agg, 1)
    round_(agg, 2)
    for k in before:
        assert torch.equal(sent[k], before[k]), k


def test_refuses_stale_updates_and_payloads_with_extra_state():
    agg = DiLoCoAggregator(Tiny(), cfg(), 2)
    stale = update(1, agg, DA, 1)
    stale.staleness = 1
    with pytest.raises(ValueError, match="stale"):
        agg.aggregate([stale, update(2, agg, DB, 3)], 1)
    leaky = update(1, agg, DA, 1)
    leaky.content["optimizer"] = {"state": {}}
    with pytest.raises(ValueError, match="optimizer"):
        agg.aggregate([leaky, update(2, agg, DB, 3)], 1)


def test_outer_state_restored_from_state_dict_continues_the_same_trajectory():
    full = DiLoCoAggregator(Tiny(), cfg(), 2)
    round_(full, 1)
    saved_state, saved_global = full.state_dict(), dict(full.global_state)
    resumed = DiLoCoAggregator(Tiny(), cfg(), 2)
    resumed.global_state = saved_global
    resumed.load_state_dict(saved_state)
    round_(full, 2)
    round_(resumed, 2)
    assert torch.allclose(w(resumed), torch.tensor([2.6135, 5.227], dtype=D), atol=1e-12)
    assert torch.equal(w(resumed), w(full))
