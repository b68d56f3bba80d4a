"""Dropout draws from the client's own stream: every executor trains the same model with
dropout on, the vectorized engine runs every fit batched, and a layer it cannot replay is
named before the first round. (Ray's actors: tests/test_ray_executor.py, on the local Ray
its other courses share.)"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fedcore.kernel.batch_order import client_randomness, round_seed
from fedcore.runtime.course import Course
from fedcore.execution.random_layers import random_layer_reason
from fedcore.scenarios.data import ClientData, FederatedData, Split
from tests.conftest import small_cfg
from tests.deploy_helpers import run_fedcore


def _images(clients: int = 5, n: int = 14, shape=(1, 8, 8)) -> FederatedData:
    """Small random images; sizes differ so a round has batches of 10 and of 4."""
    g = torch.Generator().manual_seed(7)
    empty = Split(torch.empty((0,) + shape), torch.empty(0, dtype=torch.long))
    data = {cid: ClientData(Split(torch.randn((n,) + shape, generator=g),
                                  torch.randint(0, 3, (n,), generator=g)), empty, empty)
            for cid in range(1, clients + 1)}
    test = Split(torch.randn((6,) + shape, generator=g), torch.randint(0, 3, (6,), generator=g))
    return FederatedData(data, test, shape, 3)


MODELS = {
    # the small CNN: two conv layers, dropout before and after a hidden dense layer
    "convnet2": dict(model__type="convnet2", model__norm="none", model__convnet2_hidden=12,
                     model__dropout=0.4, federate__client_num=5),
    "mlp": dict(model__type="mlp", model__hidden=[9, 7], model__mlp_dropout=0.3,
                federate__client_num=5),
}


def _run(model: str, executor: str, **extra):
    cfg = small_cfg(None, executor=executor, torch_threads=1, train__local_steps=3,
                    federate__total_round_num=3, federate__sample_client_num=4,
                    **{**MODELS[model], **extra})
    course = Course(cfg).build(_images())
    summary = course.run()
    return course, summary, {k: v.detach().clone() for k, v in course.server.aggregator.global_state.items()}


def _diff(a, b) -> float:
    """Largest difference of the entries, in order (the mlp's names shift without dropout layers)."""
    assert len(a) == len(b)
    return max(float((u.double() - v.double()).abs().max()) for u, v in zip(a.values(), b.values()))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_executor_trains_the_same_model_with_dropout_on(model):
    _, seq_summary, seq = _run(model, "sequential")
    vec_course, vec_summary, vec = _run(model, "vectorized")
    _, proc_summary, proc = _run(model, "processes", executor_workers=2)
    _, off_summary, off = _run(model, "sequential", **{"model__dropout": 0.0, "model__mlp_dropout": 0.0})
    assert _diff(seq, off) > 1e-3            # dropout really changes the course
    assert _diff(seq, vec) < 1e-5
    assert _diff(seq, proc) == 0.0           # the same computation in another process
    # 4 clients x 3 rounds; the engine ran every fit, none fell back
    assert vec_summary["batched_fits"] == 12 and vec_summary["sequential_fits"] == 0
    assert seq_summary["batched_fits"] == 0 and seq_summary["sequential_fits"] == 12
    assert proc_summary["batched_fits"] == 12


def test_a_clients_draws_do_not_depend_on_what_ran_before():
    """The client's stream is seeded from (seed, client, round) alone and the caller's
    generator is left as it was."""
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    with client_randomness(0, 5, 2):
        first = torch.rand(4)
    torch.rand(100)   # some other draw in between
    with client_randomness(0, 5, 2):
        again = torch.rand(4)
    with client_randomness(0, 6, 2):
        other = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(round_seed(0, 5, 2))))


def test_masks_drawn_by_many_threads_are_the_ones_each_clients_own_dropout_draws(monkeypatch):
    """The engine's masks for a group, drawn by several threads at once, are what each
    client's `nn.Dropout` layers draw in its sequential fit: one layer after the other, step by
    step, from the client's round stream (p = 0 and 1 draw nothing)."""
    from fedcore.execution import random_layers
    layers = [nn.Dropout(0.25), nn.Dropout(0.0), nn.Dropout(0.5), nn.Dropout(1.0)]
    model = nn.Sequential(nn.Flatten(), layers[0], nn.Linear(48, 6), layers[1], layers[2],
                          nn.Linear(6, 3), layers[3])
    monkeypatch.setattr(random_layers, "_PER_THREAD", 1)           # a thread per client ...
    monkeypatch.setattr(random_layers, "usable_cores", lambda: 4)   # ... up to 4 at once
    clients, sizes, seed, round_ = [3, 9, 4, 12, 7, 1], (10, 10, 4), 11, 6
    feed = random_layers.MaskFeed.install(model, copied=False)[1]
    masks = feed.draws(clients, round_, seed, sizes, torch.zeros(10, 3, 4, 4), torch.device("cpu"))
    for j, cid in enumerate(clients):
        with client_randomness(seed, cid, round_):
            for s, b in enumerate(sizes):
                inputs = [torch.ones(b, 48), torch.ones(b, 6), torch.ones(b, 6), torch.ones(b, 3)]
                for k, (layer, x) in enumerate(zip(layers, inputs)):
                    expected = nn.functional.dropout(x, layer.p, training=True)
                    assert torch.equal(masks[s][k][j], expected), (cid, s, k)


def test_random_layers_that_are_not_replayed_are_named():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.Dropout2d(0.2), nn.Linear(4, 2))
    assert "layer 2 (Dropout2d)" in random_layer_reason(model, torch.device("cpu"))
    plain = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2))
    assert random_layer_reason(plain, torch.device("cpu")) is None
    assert "layer 1 (Dropout) on cuda" in random_layer_reason(plain, torch.device("cuda"))


def test_a_module_that_draws_inside_its_own_functions_is_named():
    class FusedNoise(nn.Module):   # draws without a layer, and says so
        def __init__(self, p):
            super().__init__()
            self.p = p

        def unreplayed_randomness(self):
            return f"it adds noise inside its forward (p {self.p})" if self.p else None

    model = nn.Sequential(nn.Linear(4, 4), FusedNoise(0.1))
    assert random_layer_reason(model, torch.device("cpu")) == \
        "layer 1 (FusedNoise): it adds noise inside its forward (p 0.1)"
    assert random_layer_reason(nn.Sequential(nn.Linear(4, 4), FusedNoise(0.0)), torch.device("cpu")) is None


def test_clients_that_cannot_be_stacked_are_said_to_train_one_at_a_time(caplog):
    # one epoch at batch 7 over 5, 9 and 14 samples: batch plans (5), (7, 2) and (7, 7)
    data = _images(clients=3)
    for cid, n in zip((1, 2, 3), (5, 9, 14)):
        train = data.clients[cid].train
        data.clients[cid].train = Split(train.x[:n], train.y[:n])
    cfg = small_cfg(None, executor="vectorized", model__type="mlp", model__hidden=[6],
                    train__local_epochs=1, train__local_steps=None, train__batch_size=7,
                    federate__client_num=3, federate__total_round_num=2)
    course = Course(cfg).build(data)
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        summary = course.run()
    assert summary["batched_fits"] == 0 and summary["sequential_fits"] == 6
    assert caplog.text.count("no two of round 1's 3 clients share a batch plan") == 1
    assert "round 2's" not in caplog.text   # said once


def test_a_course_that_mostly_trains_one_at_a_time_says_so_at_its_end(caplog):
    # batch 7, one epoch: plans (5), (7, 2), (7, 7), (7, 7), (3): only clients 3 and 4 stack
    data = _images(clients=5)
    for cid, n in zip(range(1, 6), (5, 9, 14, 14, 3)):
        train = data.clients[cid].train
        data.clients[cid].train = Split(train.x[:n], train.y[:n])
    cfg = small_cfg(None, executor="vectorized", model__type="mlp", model__hidden=[6],
                    train__local_epochs=1, train__local_steps=None, train__batch_size=7,
                    federate__client_num=5, federate__total_round_num=2)
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        summary = Course(cfg).build(data).run()
    assert summary["batched_fits"] == 4 and summary["sequential_fits"] == 6
    assert "executor vectorized: 4 of the course's 10 fits ran batched" in caplog.text
    assert "no two of round" not in caplog.text


def test_the_decision_is_said_before_the_first_round(caplog):
    with caplog.at_level(logging.INFO, logger="fedcore.executor"):
        Course(small_cfg(None, executor="vectorized", **MODELS["mlp"])).build(_images())
    assert "executor vectorized: the clients of each broadcast train together" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedcore.executor"):
        course = Course(small_cfg(None, executor="vectorized", model__type="convnet2",
                                  model__norm="batch", model__convnet2_hidden=8,
                                  federate__client_num=5)).build(_images())
        summary = course.run()
    assert "layer features.1 (BatchNorm2d) has buffers" in caplog.text
    assert summary["batched_fits"] == 0 and summary["sequential_fits"] > 0


def test_check_names_the_layer_that_keeps_a_course_sequential(tmp_path):
    pytest.importorskip("sklearn")
    (tmp_path / "c.yaml").write_text("executor: vectorized\nverbose: false\ndata:\n  type: digits\n"
                                     "model:\n  type: convnet2\n  norm: batch\n  convnet2_hidden: 8\n"
                                     "federate:\n  client_num: 3\n")
    out = run_fedcore(["--cfg", tmp_path / "c.yaml", "--check"], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "layer features.1 (BatchNorm2d)" in out.stdout + out.stderr
