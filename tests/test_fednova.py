"""FedNova: the normalizing factor ||a_i||_1 of SGD with momentum (checked against torch's
SGD), the server's normalized averaging over two hand-computed rounds in float64, the
limiting case (equal steps, plain SGD == FedAvg exactly), variable local work (quantity
partitions, stragglers), refusals, admission of the factor, and the vectorized executor's
logged fallback."""
import logging

import pytest
import torch
from torch import nn

from fedcore.algorithms.fedprox import straggler_steps
from fedcore.algorithms.fednova import FedNovaAggregator, norm_factor
from fedcore.execution.batching import BatchingTrainer
from fedcore.comm.validation import check_updates
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg

D = torch.float64


def test_norm_factor_by_hand():
    assert norm_factor(5, 0.0) == 5.0
    # ρ = 0.5, τ = 3: a = [1 - ρ³, 1 - ρ², 1 - ρ] / (1 - ρ) = [1.75, 1.5, 1]
    assert norm_factor(3, 0.5) == pytest.approx(4.25, abs=1e-15)
    assert norm_factor(0, 0.9) == 0.0


@pytest.mark.parametrize("steps, rho", [(1, 0.9), (4, 0.5), (7, 0.9), (6, 0.0)])
def test_norm_factor_is_what_torch_sgd_with_momentum_accumulates(steps, rho):
    # a loss with a constant gradient g: x0 - x_τ = η ||a||_1 g for heavy-ball SGD from a zero buffer
    g = torch.tensor([0.3, -1.2], dtype=D)
    x = nn.Parameter(torch.tensor([1.0, 2.0], dtype=D))
    opt = torch.optim.SGD([x], lr=0.1, momentum=rho)
    for _ in range(steps):
        opt.zero_grad()
        (x * g).sum().backward()
        opt.step()
    moved = torch.tensor([1.0, 2.0], dtype=D) - x.detach()
    assert torch.allclose(moved, 0.1 * norm_factor(steps, rho) * g, rtol=0, atol=1e-13)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=D))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))


def _round(agg, moves, factors, n, r, counts=(4, 8)):
    """Client i returns x - moves[i] (so x - x_i = moves[i]) with factor a_i and n_i samples."""
    ups = []
    for cid, (move, a, ni, cnt) in enumerate(zip(moves, factors, n, counts), start=1):
        model = {"w": agg.global_state["w"] - torch.tensor(move, dtype=D), "count": torch.tensor(cnt)}
        ups.append(ReceivedUpdate(cid, {"model": model, "num_samples": ni,
                                        "nova": {"a": torch.tensor(a, dtype=D)}}, r, 0))
    return agg.aggregate(ups, r)


def test_two_rounds_by_hand():
    agg = FedNovaAggregator(Tiny(), small_cfg(algorithm__name="fednova"), 2)
    # p = (1/4, 3/4); round 1: a = (2, 4), x - x_i = [0.4, -0.2] and [0.8, 0.4]
    # τ_eff = 1/4 2 + 3/4 4 = 3.5; Σ p_i d_i = 1/4 [0.2, -0.1] + 3/4 [0.2, 0.1] = [0.2, 0.05]
    # x1 = [1, 2] - 3.5 [0.2, 0.05] = [0.3, 1.825]   (FedAvg would give [0.3, 1.75])
    metrics = _round(agg, ([0.4, -0.2], [0.8, 0.4]), (2.0, 4.0), (1, 3), 1)
    assert metrics["fednova_tau_eff"] == pytest.approx(3.5)
    assert torch.allclose(agg.global_state["w"], torch.tensor([0.3, 1.825], dtype=D), rtol=0, atol=1e-12)
    assert agg.global_state["count"].item() == 7          # integer entries: p-weighted, rounded
    # round 2: a = (1, 3), x - x_i = [0.3, 0.3] and [0.6, -0.3]; τ_eff = 1/4 + 9/4 = 2.5
    # Σ p_i d_i = 1/4 [0.3, 0.3] + 3/4 [0.2, -0.1] = [0.225, 0]; x2 = x1 - 2.5 [0.225, 0]
    _round(agg, ([0.3, 0.3], [0.6, -0.3]), (1.0, 3.0), (1, 3), 2)
    assert torch.allclose(agg.global_state["w"], torch.tensor([-0.2625, 1.825], dtype=D), rtol=0, atol=1e-12)


def test_equal_factors_are_fedavg_bit_for_bit_and_no_work_leaves_the_model():
    from fedcore.algorithms.fedavg import FedAvgAggregator
    nova = FedNovaAggregator(Tiny(), small_cfg(algorithm__name="fednova"), 2)
    avg = FedAvgAggregator(Tiny(), small_cfg(), 2)
    for r, moves in enumerate((([0.4, -0.2], [0.8, 0.4]), ([0.1, 0.7], [-0.3, 0.2])), start=1):
        _round(nova, moves, (6.0, 6.0), (2, 7), r)
        _round(avg, moves, (6.0, 6.0), (2, 7), r)
        assert torch.equal(nova.global_state["w"], avg.global_state["w"])
    before = nova.global_state["w"]
    _round(nova, ([0.4, -0.2], [0.8, 0.4]), (0.0, 0.0), (2, 7), 3)
    assert torch.equal(nova.global_state["w"], before)


def test_a_negative_factor_counts_as_no_work_with_a_warning(caplog):
    agg = FedNovaAggregator(Tiny(), small_cfg(algorithm__name="fednova"), 2)
    with caplog.at_level(logging.WARNING, logger="fedcore.fednova"):
        _round(agg, ([0.4, -0.2], [0.8, 0.4]), (-1.0, 4.0), (1, 3), 1)
    assert any("client 1" in r.getMessage() for r in caplog.records)
    # τ_eff = 3/4 4 = 3 (client 1 adds nothing); x1 = x0 - 3 (3/4 [0.2, 0.1]) = [0.55, 1.775]
    assert torch.allclose(agg.global_state["w"], torch.tensor([0.55, 1.775], dtype=D), rtol=0, atol=1e-12)


def _final(tmp_path, name, **keys):
    course = Course(small_cfg(tmp_path / name, model__dtype="float64", eval__clients=False, **keys))
    course.run()
    return course, torch.load(tmp_path / name / "final_model.pt", weights_only=True)


@pytest.mark.parametrize("work", [dict(train__local_steps=3), dict(train__local_epochs=2)])
def test_course_with_equal_steps_and_plain_sgd_equals_fedavg(tmp_path, work):
    _, a = _final(tmp_path, "nova", algorithm__name="fednova", **work)
    _, b = _final(tmp_path, "avg", **work)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_clients_report_the_factor_of_the_steps_they_took(tmp_path):
    # quantity partition: unequal sizes, so unequal epochs x batches; stragglers on top
    keys = dict(algorithm__name="fednova", data__partition="quantity",
                data__synthetic__samples_per_client=None, train__local_epochs=2,
                train__optimizer__momentum=0.9, algorithm__fednova__straggler_fraction=0.5)
    course = Course(small_cfg(tmp_path / "c", **keys)).build()
    received = course.server.aggregator.broadcast(1)
    reported, expected = [], []
    for cid in course.client_ids:
        n = len(course.data.clients[cid].train)
        per_epoch = -(-n // 10)
        steps = straggler_steps(0, 1, cid, 0.5, 2, per_epoch, 2 * per_epoch)
        result = course.trainer.fit(cid, course.data.clients[cid], received, 1)
        reported.append(float(result.content["nova"]["a"]))
        expected.append(norm_factor(steps, 0.9))
        assert result.work == pytest.approx(sum(min(10, n - (i % per_epoch) * 10)
                                                for i in range(steps)))
    assert reported == pytest.approx(expected, abs=1e-12)
    assert len(set(round(a, 9) for a in reported)) > 2       # the work really differs
    _, nova = _final(tmp_path, "nova", **keys)
    _, avg = _final(tmp_path, "avg", **{**keys, "algorithm__name": "fedavg"})
    assert not torch.equal(nova["1.weight"], avg["1.weight"])


@pytest.mark.parametrize("keys, match", [
    (dict(train__optimizer__type="adam"), "train.optimizer.type"),
    (dict(train__preserve_optimizer_state=True), "train.preserve_optimizer_state"),
    (dict(train__scheduler__type="cosine", train__scheduler__total_steps=5), "train.scheduler.type"),
    (dict(aggregator__robust_rule="median"), "aggregator.robust_rule"),
])
def test_refusals_name_the_key(keys, match):
    with pytest.raises(ConfigError, match=match):
        small_cfg(algorithm__name="fednova", **keys)


def test_admission_wants_the_factor_as_a_float64_scalar():
    course = Course(small_cfg(None, algorithm__name="fednova")).build()
    server = course.server
    model = dict(server.aggregator.broadcast(1)["model"])
    good = {"model": model, "num_samples": 3, "nova": {"a": torch.tensor(2.0, dtype=D)}}
    assert check_updates(good, server) is None
    assert "nova" in check_updates({"model": model, "num_samples": 3}, server)
    bad = dict(good, nova={"a": torch.tensor(float("nan"), dtype=D)})
    assert "non-finite" in check_updates(bad, server)


def test_vectorized_executor_falls_back_with_a_reason_and_the_same_numbers(caplog):
    keys = dict(algorithm__name="fednova", train__local_steps=2, torch_threads=1)
    seq = Course(small_cfg(None, **keys)).build()
    seq.run()
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        vec = Course(small_cfg(None, executor="vectorized", **keys)).build()
        vec.run()
    assert not isinstance(vec.trainer, BatchingTrainer)
    assert any("FedNovaTrainer" in r.getMessage() and "running sequentially" in r.getMessage()
               for r in caplog.records)
    a, b = seq.server.aggregator.global_state, vec.server.aggregator.global_state
    assert all(torch.equal(a[k], b[k]) for k in a)
