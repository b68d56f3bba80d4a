"""SCAFFOLD (Algorithm 1, option II) against hand-computed numbers, its limit, payloads and bytes."""
import json

import numpy as np
import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests import drift_problem as P
from tests.conftest import small_cfg

SCHEDULE = {1: (1, 2), 2: (2, 3)}    # partial participation: |S| = 2 of N = 3


def _reference(global_lr: float, weighting: str):
    x, c = P.THETA0.copy(), np.zeros(3)
    c_i = {k: np.zeros(3) for k in (1, 2, 3)}
    sent = {}
    for r, clients in SCHEDULE.items():
        dy, dc = {}, {}
        for k in clients:
            y = x.copy()
            for _ in range(P.STEPS):
                y = y - P.LR * (P.grad(k, y) + c - c_i[k])
            new = c_i[k] - c + (x - y) / (P.STEPS * P.LR)
            dy[k], dc[k] = y - x, new - c_i[k]
            c_i[k] = new
        w = {k: 1.0 if weighting == "uniform" else P.n_samples(k) for k in clients}
        x = x + global_lr * sum(w[k] * dy[k] for k in clients) / sum(w.values())
        c = c + sum(dc.values()) / 3
        sent[r] = (dy, dc)
    return x, c, c_i, sent


@pytest.mark.parametrize("weighting", ["uniform", "num_samples"])
def test_scaffold_two_rounds_match_hand_computation(weighting):
    cfg = P.config("scaffold", algorithm__scaffold__global_lr=0.8, algorithm__scaffold__weighting=weighting)
    trainer, agg = P.build(cfg)
    x, c, c_i, sent = _reference(0.8, weighting)
    for r, clients in SCHEDULE.items():
        results = P.run_round(trainer, agg, r, clients)
        for k in clients:
            content = results[k].content
            assert set(content) == {"delta", "delta_control", "num_samples"}
            np.testing.assert_allclose(P.as_theta(content["delta"]), sent[r][0][k], atol=1e-6)
            np.testing.assert_allclose(P.as_theta(content["delta_control"]), sent[r][1][k], atol=1e-6)
    np.testing.assert_allclose(P.as_theta(agg.global_state), x, atol=1e-6)
    np.testing.assert_allclose(P.as_theta(agg.control), c, atol=1e-6)
    for k in (1, 2, 3):
        np.testing.assert_allclose(P.as_theta(trainer.store.load(k)["c_i"]), c_i[k], atol=1e-6)
    assert np.abs(c).max() > 1e-3 and np.abs(c_i[2]).max() > 1e-3   # the corrections are live


def test_broadcast_carries_model_and_control_and_is_never_mutated():
    trainer, agg = P.build(P.config("scaffold"))
    sent = agg.broadcast(1)
    assert set(sent) == {"model", "control"} and set(sent["control"]) == {"1.weight", "1.bias"}
    before = {k: v.clone() for k, v in sent["model"].items()}
    P.run_round(trainer, agg, 1, (1, 2, 3))
    assert all(torch.equal(before[k], sent["model"][k]) for k in before)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in sent["control"].values())
    assert set(agg.evaluation_content(2)) == {"model"}


def test_first_round_is_uniform_fedavg(tmp_path):
    # equal client sizes: FedAvg's sample weights are uniform
    common = dict(model__dtype="float64", federate__total_round_num=1)
    Course(small_cfg(tmp_path / "s", algorithm__name="scaffold", **common)).run()
    Course(small_cfg(tmp_path / "f", algorithm__name="fedavg", **common)).run()
    ms = torch.load(tmp_path / "s" / "final_model.pt", weights_only=True)
    mf = torch.load(tmp_path / "f" / "final_model.pt", weights_only=True)
    for k in mf:   # x + mean(y_i - x) vs mean(y_i): equal up to float64 rounding
        torch.testing.assert_close(ms[k], mf[k], rtol=0, atol=1e-12)


def test_scaffold_moves_twice_the_model_each_way(tmp_path):
    common = dict(**{"eval.clients": False}, model__type="mlp", model__hidden=[32])
    Course(small_cfg(tmp_path / "s", algorithm__name="scaffold", **common)).run()
    Course(small_cfg(tmp_path / "f", algorithm__name="fedavg", **common)).run()
    rs = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    rf = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    n_params = 8 * 32 + 32 + 32 * 3 + 3
    model_bytes = 4 * n_params                                    # float32 tensors, 6 clients per round
    for s, f in zip(rs, rf):
        for key in ("bytes_up", "bytes_down"):
            assert s[key] - f[key] >= 6 * model_bytes            # one extra model-sized set per message
            assert s[key] - f[key] < 6 * (model_bytes + 200)     # ... and little else (names, framing)
            assert 1.9 < s[key] / f[key] < 2.1


def test_async_refused_unless_allowed():
    from fedcore.kernel.config import SCHEMA, declare
    added = "asyn.use" not in SCHEMA
    if added:
        declare("asyn.use", bool, False, "asynchronous training on/off")
    try:
        with pytest.raises(ConfigError, match="allow_async"):
            small_cfg(None, algorithm__name="scaffold", asyn__use=True)
        small_cfg(None, algorithm__name="scaffold", asyn__use=True, algorithm__scaffold__allow_async=True)
        small_cfg(None, algorithm__name="fedavg", asyn__use=True)
    finally:
        if added:
            SCHEMA.pop("asyn.use")


def test_non_sgd_optimizer_warns(caplog):
    with caplog.at_level("WARNING", logger="fedcore.algorithms.scaffold"):
        P.build(P.config("scaffold", train__optimizer__momentum=0.9))
    assert "not plain SGD" in caplog.text


def test_control_variate_divides_by_the_step_sizes_taken_under_an_lr_schedule():
    # One local step at warmup LR eta/4 from c = c_i = 0: c_i+ = (x - y)/eta_0 is the gradient at x.
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg
    cfg = small_cfg(None, algorithm__name="scaffold", model__dtype="float64", train__local_steps=1,
                    train__batch_size=1000, train__scheduler__type="cosine",
                    train__scheduler__warmup_steps=4, train__scheduler__total_steps=10,
                    federate__total_round_num=1, eval__clients=False)
    course = Course(cfg).build()
    x = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    course.run()
    model = course.trainer.model
    model.load_state_dict(x)
    train = course.data.clients[1].train
    loss = torch.nn.functional.cross_entropy(model(train.x), train.y)
    grads = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    c_i = course.store.load(1)["c_i"]
    for n, g in grads.items():
        assert torch.allclose(c_i[n], g, atol=1e-10)


def test_global_lr_scales_the_parameters_step_and_buffers_take_the_plain_mean():
    # eta_g = 0.5, two clients (uniform): dy(w) = [1, -2] and [3, 0], mean [2, -1], so
    # w = [1, 2] + 0.5 [2, -1] = [2, 1.5]; the float buffer's deltas [0.4] and [0.8] are running
    # statistics, not a step: mean 0.6, so [0.1] + 0.6 = [0.7]; the integer counter: 3 + 2 = 5
    from torch import nn

    from fedcore.algorithms.scaffold import ScaffoldAggregator
    from fedcore.kernel.contract import ReceivedUpdate

    class WithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
            self.register_buffer("running", torch.tensor([0.1], dtype=torch.float64))
            self.register_buffer("count", torch.tensor(3))

    cfg = small_cfg(None, algorithm__name="scaffold", algorithm__scaffold__global_lr=0.5)
    agg = ScaffoldAggregator(WithBuffers(), cfg, 2)
    moves = [([1.0, -2.0], [0.4], 2), ([3.0, 0.0], [0.8], 2)]
    updates = [ReceivedUpdate(cid, {"num_samples": 1, "delta": {
        "w": torch.tensor(w, dtype=torch.float64), "running": torch.tensor(r, dtype=torch.float64),
        "count": torch.tensor(c)}, "delta_control": {"w": torch.zeros(2, dtype=torch.float64)}}, 1)
        for cid, (w, r, c) in enumerate(moves, start=1)]
    agg.aggregate(updates, 1)
    g = agg.global_state
    assert torch.allclose(g["w"], torch.tensor([2.0, 1.5], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.allclose(g["running"], torch.tensor([0.7], dtype=torch.float64), rtol=0, atol=1e-15)
    assert g["count"].item() == 5
