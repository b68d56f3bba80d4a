"""Client side of DiLoCo: exactly H optimizer steps (also mid-epoch and with gradient
accumulation), the end-of-training path, a data stream that advances across rounds, and
inner optimizer / scheduler state that persists per logical client."""
import math

import pytest
import torch

from fedcore.kernel.contract import BatchStream
from fedcore.algorithms.fedavg import FedAvgTrainer
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg

# small_cfg: 30 samples per client, 80% train -> 24 training samples; batch 10 -> 3 batches/epoch


def diloco_cfg(**kw):
    base = dict(algorithm__name="diloco", train__local_steps=2, train__optimizer__type="adamw",
                train__optimizer__lr=0.01, train__preserve_optimizer_state=True)
    base.update(kw)
    return small_cfg(**base)


def built(cfg):
    return Course(cfg).build()


def count_steps(trainer) -> list[int]:
    """A counter of real optimizer.step() calls on `trainer`'s optimizer."""
    calls = [0]
    trainer.optimizer.register_step_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def received(course):
    return course.server.aggregator.broadcast(1)


def test_h_smaller_than_one_epoch_takes_exactly_h_steps_and_stops_mid_epoch():
    course = built(diloco_cfg())
    tr, calls = course.trainer, count_steps(course.trainer)
    result = tr.fit(1, course.data.clients[1], received(course), 1)
    state = course.store.load(1)
    assert calls[0] == 2
    assert state["sampler"] == {"epoch": 0, "offset": 20}          # 2 of 3 batches: mid-epoch
    assert state["inner_steps"] == 2
    assert all(int(s["step"]) == 2 for s in state["optimizer"]["state"].values())
    assert result.work == 20.0 and "train_loss" in result.metrics


def test_gradient_accumulation_counts_only_completed_optimizer_steps():
    course = built(diloco_cfg(train__local_steps=3, train__grad_accum_steps=2))
    tr, calls = course.trainer, count_steps(course.trainer)
    result = tr.fit(1, course.data.clients[1], received(course), 1)
    state = course.store.load(1)
    assert calls[0] == 3                                            # H = 3, not 6 micro-batches
    assert state["inner_steps"] == 3
    assert all(int(s["step"]) == 3 for s in state["optimizer"]["state"].values())
    # 6 micro-batches of 10 over 24 samples: 10, 10, 4 | 10, 10, 4
    assert state["sampler"] == {"epoch": 1, "offset": 24}
    assert result.work == 48.0


def test_accumulated_micro_batches_equal_one_step_on_their_union():
    kw = dict(train__local_steps=1, train__optimizer__type="sgd", train__optimizer__lr=0.5)
    small = built(small_cfg(train__batch_size=5, train__grad_accum_steps=2, **kw))
    large = built(small_cfg(train__batch_size=10, **kw))
    a = small.trainer.fit(1, small.data.clients[1], received(small), 1).content["model"]
    b = large.trainer.fit(1, large.data.clients[1], received(large), 1).content["model"]
    g0 = received(large)["model"]
    for k in a:
        assert not torch.equal(b[k], g0[k])                          # it did train
        assert torch.allclose(a[k], b[k], atol=1e-6), k


class Recording(FedAvgTrainer):
    """Records each step's mini-batch, the LR it used, and the end-of-training calls."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches, self.lrs, self.ends = [], [], []
        self.steps_seen = 0
        self.optimizer.register_step_post_hook(self._seen)

    def _seen(self, *_):
        self.steps_seen += 1

    def step(self, x, y):
        self.batches.append(x.clone())
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        return super().step(x, y)

    def end(self, client_state, received, steps):
        self.ends.append((steps, self.steps_seen))
        super().end(client_state, received, steps)


def recording(cfg):
    course = built(cfg)
    return course, Recording(course.trainer.model, cfg, course.store)


def test_end_of_training_path_runs_once_after_exactly_h_steps():
    course, tr = recording(small_cfg(train__local_steps=2))
    tr.fit(1, course.data.clients[1], received(course), 1)
    tr.fit(1, course.data.clients[1], received(course), 2)
    assert tr.ends == [(2, 2), (2, 4)]                              # no extra step after H


def test_data_stream_advances_across_rounds_instead_of_replaying():
    cfg = small_cfg(train__local_steps=2)
    course, tr = recording(cfg)
    data = course.data.clients[1]
    tr.fit(1, data, received(course), 1)
    tr.fit(1, data, received(course), 2)
    stream = BatchStream(len(data.train), 10, cfg["seed"], 1)
    expected = [data.train.x[stream.next()] for _ in range(4)]
    assert len(tr.batches) == 4
    for got, exp in zip(tr.batches, expected):
        assert torch.equal(got, exp)
    assert not torch.equal(tr.batches[2], tr.batches[0])            # round 2 did not restart
    assert course.store.load(1)["sampler"] == {"epoch": 1, "offset": 10}


def _snapshot(opt_state):
    return {i: {k: v.clone() for k, v in s.items()} for i, s in opt_state["state"].items()}


def test_adamw_state_persists_per_logical_client_like_uninterrupted_training():
    cfg = diloco_cfg()
    mixed, alone = built(cfg), built(cfg)
    g0 = received(mixed)
    g1 = {"model": {k: v + 0.01 for k, v in g0["model"].items()}}
    mixed.trainer.fit(1, mixed.data.clients[1], g0, 1)
    before = _snapshot(mixed.store.load(1)["optimizer"])
    mixed.trainer.fit(2, mixed.data.clients[2], g0, 1)               # another client in between
    after_other = _snapshot(mixed.store.load(1)["optimizer"])
    for i in before:
        for k in before[i]:
            assert torch.equal(before[i][k], after_other[i][k])     # client 2 left client 1 alone
    assert all(int(s["step"]) == 2 for s in mixed.store.load(2)["optimizer"]["state"].values())
    m = mixed.trainer.fit(1, mixed.data.clients[1], g1, 2).content["model"]
    alone.trainer.fit(1, alone.data.clients[1], g0, 1)
    a = alone.trainer.fit(1, alone.data.clients[1], g1, 2).content["model"]
    for k in m:
        assert torch.equal(m[k], a[k]), k
    sm, sa = mixed.store.load(1)["optimizer"]["state"], alone.store.load(1)["optimizer"]["state"]
    for i in sa:
        assert int(sm[i]["step"]) == 4
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sm[i][k], sa[i][k])


def test_without_preservation_nothing_is_kept_and_each_round_starts_fresh():
    course = built(small_cfg(train__local_steps=2, train__optimizer__type="adamw"))
    course.trainer.fit(1, course.data.clients[1], received(course), 1)
    state = course.store.load(1)
    assert "optimizer" not in state and "scheduler" not in state
    assert course.trainer.optimizer.state.get(course.trainer.params[0]) is not None
    course.trainer.fit(2, course.data.clients[2], received(course), 1)
    assert all(int(s["step"]) == 2 for s in course.trainer.optimizer.state.values())


def test_scheduler_state_persists_per_client_and_new_clients_start_at_step_zero():
    cfg = diloco_cfg(train__optimizer__lr=0.1, train__scheduler__type="cosine",
                     train__scheduler__warmup_steps=2, train__scheduler__total_steps=6)
    course, tr = recording(cfg)
    g = received(course)
    tr.fit(1, course.data.clients[1], g, 1)
    tr.fit(2, course.data.clients[2], g, 1)
    tr.fit(1, course.data.clients[1], g, 2)
    cos = 0.1 * 0.5 * (1 + math.cos(math.pi * 0.25))               # t = 3: progress 1/4
    assert tr.lrs == pytest.approx([0.05, 0.1, 0.05, 0.1, 0.1, cos])
    assert course.store.load(1)["scheduler"]["last_epoch"] == 4
    assert course.store.load(2)["scheduler"]["last_epoch"] == 2


def test_fedavg_default_trains_as_before():
    """Default keys (no accumulation, no scheduler): one optimizer step per mini-batch."""
    course, tr = recording(small_cfg())                            # 1 local epoch: 3 batches
    tr.fit(1, course.data.clients[1], received(course), 1)
    assert tr.ends == [(3, 3)]
    assert tr.lrs == [0.1, 0.1, 0.1]
    assert course.store.load(1)["sampler"] == {"epoch": 0, "offset": 24}


def test_diloco_round_that_cannot_take_h_steps_fails_instead_of_sending():
    from fedcore.scenarios.data import ClientData, Split
    course = built(diloco_cfg())
    full = course.data.clients[1]
    empty = ClientData(Split(full.train.x[:0], full.train.y[:0]), full.val, full.test)
    with pytest.raises(RuntimeError, match="took 0 optimizer steps this round, not H=2"):
        course.trainer.fit(1, empty, received(course), 1)
    assert 1 not in course.store                                   # nothing half-saved


class FailsInSecondRound(FedAvgTrainer):
    def step(self, x, y):
        if self.armed and self.optimizer.state and all(
                int(s["step"]) >= 3 for s in self.optimizer.state.values()):
            raise RuntimeError("boom")
        return super().step(x, y)


def test_a_fit_that_fails_half_way_leaves_the_saved_optimizer_state_as_it_was():
    cfg = diloco_cfg()
    course = built(cfg)
    tr = FailsInSecondRound(course.trainer.model, cfg, course.store)
    tr.armed = False
    tr.fit(1, course.data.clients[1], received(course), 1)          # steps 1-2 saved
    saved = _snapshot(course.store.load(1)["optimizer"])
    tr.armed = True
    with pytest.raises(RuntimeError, match="boom"):
        tr.fit(1, course.data.clients[1], received(course), 2)      # step 3 taken, then fails
    now = course.store.load(1)["optimizer"]["state"]
    for i in saved:
        for k in saved[i]:
            assert torch.equal(now[i][k], saved[i][k]), k


@pytest.mark.parametrize("algorithm, extra", [("fedmos", {}), ("moon", {"model__type": "moon_mlp"})])
def test_accumulation_is_refused_for_trainers_with_their_own_step(algorithm, extra):
    # accumulated_step runs the base objective and optimizer: MOON's and FedMoS's updates would vanish
    with pytest.raises(ConfigError, match="train.grad_accum_steps: algorithm"):
        small_cfg(algorithm__name=algorithm, train__grad_accum_steps=2, **extra)
    small_cfg(algorithm__name="fedprox", train__grad_accum_steps=2)  # hooks compose with accumulation
