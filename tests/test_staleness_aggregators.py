"""Staleness discounts and the FedBuff / FedAsync rules against hand-computed numbers."""
import pytest
import torch

from fedcore.kernel.contract import Aggregator, ReceivedUpdate
from fedcore.algorithms.fedasync import FedAsyncAggregator
from fedcore.algorithms.fedbuff import FedBuffAggregator, FedBuffTrainer
from fedcore.algorithms.staleness import discount_function, hinge, polynomial
from fedcore.runtime.course import Course
from fedcore.kernel.state import make_state_store
from tests.conftest import small_cfg


class _Lin(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=torch.float32))


def test_discount_families():
    assert polynomial(0, 0.5) == 1.0 and polynomial(3, 0.5) == 0.5 and polynomial(1, 1.0) == 0.5
    assert hinge(4, 10, 4) == 1.0 and hinge(5, 10, 4) == pytest.approx(1 / 11)
    assert hinge(6, 10, 4) == pytest.approx(1 / 21)
    assert discount_function(small_cfg(asyn__staleness_discount="none")) is None
    f = discount_function(small_cfg(asyn__staleness_discount="polynomial", asyn__staleness_exponent=2.0))
    assert f(0) == 1.0 and f(1) == 0.25
    g = discount_function(small_cfg(asyn__staleness_discount="hinge", asyn__staleness_hinge_a=1.0,
                                    asyn__staleness_hinge_b=0.0))
    assert g(0) == 1.0 and g(3) == 0.25


def upd(cid, tau, **content):
    return ReceivedUpdate(cid, content, 0, tau)


def test_fedavg_weights_are_discounted_by_staleness():
    agg = Aggregator(_Lin([0.0]), small_cfg(), 2)
    agg.discount = lambda tau: polynomial(tau, 0.5)
    ups = [upd(1, 0, model={"w": torch.tensor([1.0])}, num_samples=1),
           upd(2, 3, model={"w": torch.tensor([3.0])}, num_samples=1)]
    agg.aggregate(ups, 1)
    assert agg.global_state["w"].item() == pytest.approx((1 * 1 + 0.5 * 3) / 1.5)   # 5/3
    agg.discount = None
    agg.aggregate(ups, 2)
    assert agg.global_state["w"].item() == pytest.approx(2.0)


def test_fedbuff_rule_and_its_fedavg_limit():
    cfg = small_cfg(algorithm__name="fedbuff", algorithm__fedbuff__server_lr=0.5)
    agg = FedBuffAggregator(_Lin([1.0, 1.0]), cfg, 2)
    before = agg.global_state["w"]
    agg.discount = lambda tau: polynomial(tau, 1.0)
    ups = [upd(1, 0, delta={"w": torch.tensor([2.0, 0.0])}, model={}, num_samples=5),
           upd(2, 1, delta={"w": torch.tensor([0.0, 4.0])}, model={}, num_samples=50)]
    agg.aggregate(ups, 1)
    # w + 0.5 * (1/2) * (1 * [2, 0] + 0.5 * [0, 4]) = [1.5, 1.5]
    assert agg.global_state["w"].tolist() == pytest.approx([1.5, 1.5])
    assert before.tolist() == [1.0, 1.0]                 # the broadcast tensor is untouched
    # eta_g = 1, fresh updates: the unweighted mean of the local models ([3, 1] and [1, 5])
    agg = FedBuffAggregator(_Lin([1.0, 1.0]), small_cfg(algorithm__name="fedbuff"), 2)
    agg.aggregate([upd(1, 0, delta={"w": torch.tensor([2.0, 0.0])}, model={}, num_samples=1),
                   upd(2, 0, delta={"w": torch.tensor([0.0, 4.0])}, model={}, num_samples=1)], 1)
    assert agg.global_state["w"].tolist() == pytest.approx([2.0, 3.0])


def test_fedbuff_trainer_sends_the_change_of_the_weights():
    cfg = small_cfg(algorithm__name="fedbuff")
    model = _Lin([1.0, 2.0])
    trainer = FedBuffTrainer(model, cfg, make_state_store("memory", None))
    with torch.no_grad():
        model.w.copy_(torch.tensor([1.5, 1.0]))
    out = trainer.payload({}, {"model": {"w": torch.tensor([1.0, 2.0])}}, 1, 7)
    assert out["delta"]["w"].tolist() == [0.5, -1.0] and out["num_samples"] == 7 and out["model"] == {}


def test_fedasync_mixing_rule():
    agg = FedAsyncAggregator(_Lin([0.0]), small_cfg(algorithm__name="fedasync"), 2)   # alpha 0.6
    before = agg.global_state["w"]
    agg.discount = lambda tau: polynomial(tau, 0.5)
    agg.aggregate([upd(1, 0, model={"w": torch.tensor([10.0])}),
                   upd(2, 3, model={"w": torch.tensor([0.0])})], 1)
    # 0 -> 0.4*0 + 0.6*10 = 6 -> alpha 0.6*0.5 = 0.3: 0.7*6 + 0.3*0 = 4.2
    assert agg.global_state["w"].item() == pytest.approx(4.2)
    assert before.item() == 0.0


def test_fedbuff_in_a_sync_round_equals_fedavg_with_equal_client_sizes():
    """Equal sample counts, eta_g = 1, no staleness: mean of deltas == FedAvg's mean of models."""
    states = []
    for name in ("fedavg", "fedbuff"):
        course = Course(small_cfg(None, algorithm__name=name, federate__total_round_num=1,
                                  eval__clients=False))
        course.run()
        states.append(course.server.aggregator.global_state)
    for k in states[0]:
        assert torch.allclose(states[0][k], states[1][k], atol=1e-6)
