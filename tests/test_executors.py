"""Executors: `vectorized` and `processes` give the sequential executor's numbers, with the
same virtual times and byte counts, and fall back to sequential (with a logged reason)
where the trainer or config cannot apply; a behaviour whose wrapper of the training an
executor cannot run is refused when the course is built."""
import logging

import pytest
import torch

from fedcore.kernel.contract import Trainer
from fedcore.execution.batching import BatchingTrainer
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.message import Message
from fedcore.kernel.registry import algorithms
from fedcore.kernel.contract import Aggregator, Algorithm
from fedcore.kernel.vector_term import VectorTerm
from tests.conftest import small_cfg

TRACE_KEYS = ("round", "virtual_time", "bytes_up", "bytes_down", "num_updates")


def _run(executor, **overrides):
    course = Course(small_cfg(None, executor=executor, torch_threads=1, **overrides)).build()
    course.run()
    trace = [tuple(r.get(k) for k in TRACE_KEYS) for r in course.monitor.records]
    return course, dict(course.server.aggregator.global_state), trace


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


CASES = {
    "one_step": dict(train__local_steps=1, federate__total_round_num=3),
    # power-law sizes: clients differ in batch shapes, so several vmap groups per round;
    # momentum and weight decay exercise the whole SGD rule; sampling leaves clients idle
    "epochs_momentum_groups": dict(data__synthetic__samples_per_client=None,
                                   data__synthetic__max_samples=60, train__local_epochs=2,
                                   train__optimizer__momentum=0.9,
                                   train__optimizer__weight_decay=0.01,
                                   federate__sample_client_num=4, federate__total_round_num=3),
    "no_training_data": dict(data__splits=[0.0, 0.5, 0.5]),   # every client sends the model back
    "float64_mlp": dict(model__type="mlp", model__hidden=[7], model__dtype="float64",
                        train__local_steps=3),
    # algorithms with an extra gradient term and per-client state, over rounds that resample
    "fedprox_stragglers": dict(algorithm__name="fedprox", algorithm__fedprox__mu=0.5,
                               algorithm__fedprox__straggler_fraction=0.5, train__local_epochs=2,
                               federate__total_round_num=3),
    "scaffold": dict(algorithm__name="scaffold", train__local_steps=3, federate__sample_client_num=2,
                     federate__total_round_num=4),
    "scaffold_momentum_mlp": dict(algorithm__name="scaffold", model__type="mlp", model__hidden=[5],
                                  train__optimizer__momentum=0.5, train__local_steps=2,
                                  federate__total_round_num=3),
    "feddyn": dict(algorithm__name="feddyn", algorithm__feddyn__alpha=0.3, train__local_steps=3,
                   federate__sample_client_num=2, federate__total_round_num=4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_vectorized_equals_sequential(case):
    _, seq, seq_trace = _run("sequential", **CASES[case])
    course, vec, vec_trace = _run("vectorized", **CASES[case])
    assert isinstance(course.trainer, BatchingTrainer)
    assert course.trainer.batched_fits > 0 and course.trainer.sequential_fits == 0
    assert _max_diff(seq, vec) < 1e-5
    assert vec_trace == seq_trace          # same virtual times, bytes and updates per round


@pytest.mark.parametrize("case", ["one_step", "epochs_momentum_groups"])
def test_processes_equal_sequential(case):
    _, seq, seq_trace = _run("sequential", **CASES[case])
    course, par, par_trace = _run("processes", executor_workers=2, **CASES[case])
    assert course.trainer.batched_fits > 0
    assert _max_diff(seq, par) == 0.0      # the same computation, only in other processes
    assert par_trace == seq_trace
    assert course.trainer.engine._procs == []   # the pool is shut down at the end of the run


class _ProxLike(Trainer):
    """A trainer with its own objective: not the base SGD step, so it is not vectorised."""

    def objective(self, x, y):
        return super().objective(x, y) + 0.0 * sum(p.sum() for p in self.params)


algorithms.register("_test_proxlike", Algorithm(_ProxLike, Aggregator))


@pytest.mark.parametrize("overrides, reason", [
    (dict(train__optimizer__type="adam"), "only sgd is vectorised"),
    (dict(algorithm__name="_test_proxlike"), "changes objective"),
])
def test_vectorized_falls_back_with_a_reason(caplog, overrides, reason):
    _, seq, _ = _run("sequential", **overrides)
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        course, vec, _ = _run("vectorized", **overrides)
    assert not isinstance(course.trainer, BatchingTrainer)
    assert any(reason in r.getMessage() and "running sequentially" in r.getMessage()
               for r in caplog.records)
    assert _max_diff(seq, vec) == 0.0


def test_a_result_is_not_used_once_the_client_trained_again():
    """Between a batch's computation and a client's delivery, another fit of that client
    makes the batched result stale: the client is then trained from its current state."""
    course = Course(small_cfg(None, executor="vectorized", train__local_steps=1)).build()
    front, plain = course.trainer, course.trainer._trainer
    content = {"model": course.server.aggregator.broadcast(1)["model"]}
    other = {"model": {k: v + 0.5 for k, v in content["model"].items()}}
    msg = Message("models", 0, (1, 2), 1, 0.0, content)
    for r in msg.receivers:
        front._note(msg, r)
    data = {c: course.clients[c].data for c in (1, 2)}
    first = front.fit(1, data[1], content, 1)          # computes the batch for 1 and 2
    front.fit(2, data[2], other, 1)                    # client 2 trains on something else first
    state_before = dict(course.store.load(2))
    late = front.fit(2, data[2], content, 1)
    assert front.batched_fits == 1 and front.sequential_fits == 2
    # what the sequential trainer gives from client 2's current state
    course.store.save(2, state_before)
    expected = plain.fit(2, data[2], content, 1)
    assert _max_diff(late.content["model"], expected.content["model"]) == 0.0
    assert first.content["num_samples"] == len(data[1].train)


def test_torch_threads_key_sets_the_thread_count():
    before = torch.get_num_threads()
    try:
        Course(small_cfg(None, torch_threads=1)).build()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


class _HelperOnly(Trainer):
    """Defines only a helper: the vectoriser cannot know whether a hook uses it, so it refuses."""

    def scale(self) -> float:
        return 1.0


def test_a_trainer_defining_anything_of_its_own_is_not_vectorised(caplog):
    algorithms.register("_test_helper_only", Algorithm(_HelperOnly, Aggregator))
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        course = Course(small_cfg(None, executor="vectorized",
                                  algorithm__name="_test_helper_only")).build()
    assert not isinstance(course.trainer, BatchingTrainer)
    assert any("changes scale" in r.getMessage() for r in caplog.records)


def test_vectorized_gathers_per_client_when_data_are_too_big_to_stack(monkeypatch):
    import fedcore.execution.vectorized as vectorized
    monkeypatch.setattr(vectorized, "_STACK_BYTES", 0)
    case = CASES["epochs_momentum_groups"]
    _, seq, _ = _run("sequential", **case)
    _, vec, _ = _run("vectorized", **case)
    assert _max_diff(seq, vec) < 1e-5


def test_processes_fall_back_for_good_when_a_state_cannot_travel(caplog):
    plugin = dict(plugins=["tests.int_key_plugin"], algorithm__name="_test_intkeys")
    _, seq, seq_trace = _run("sequential", **plugin)
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        course, par, par_trace = _run("processes", executor_workers=2, **plugin)
    assert any("running sequentially from now on" in r.getMessage() for r in caplog.records)
    assert not any("building the course" in r.getMessage() for r in caplog.records)
    assert course.trainer.batched_fits == 0
    assert _max_diff(seq, par) == 0.0 and par_trace == seq_trace


DP_LOCAL = dict(privacy__dp__mode="local", privacy__dp__noise_multiplier=0.5)   # wraps fit: noise
DITTO = dict(personalization__method="ditto")                                  # wraps fit: personal model
LABEL_FLIP = dict(attack__type="label_flip", attack__clients=[1, 2])           # attackers' own data
TOPK = dict(compress__type="topk", compress__topk_fraction=0.3)   # wraps fit: encodes, keeps a residual
INT8 = dict(compress__type="int8")                                # wraps fit: stochastic rounding


@pytest.mark.parametrize("executor, overrides", [
    (executor, overrides) for executor in ("vectorized", "processes")
    for overrides in (DP_LOCAL, DITTO, LABEL_FLIP, TOPK, INT8)
    if not (executor == "vectorized" and overrides is DITTO)   # refused: see below
])
def test_behaviours_give_the_sequential_numbers_under_every_executor(executor, overrides):
    # Each executor the course accepts must give the sequential result.
    _, seq, seq_trace = _run("sequential", eval__clients=False, **overrides)
    _, other, trace = _run(executor, executor_workers=2, eval__clients=False, **overrides)
    assert _max_diff(seq, other) < 1e-5
    assert trace == seq_trace


@pytest.mark.parametrize("overrides", [DP_LOCAL, TOPK])
def test_a_wrapper_of_a_clients_result_runs_around_the_vectorized_batch(overrides):
    # local DP and compression need only a fit's inputs and result: the engine trains the
    # clients together and their wrappers run around each client's result, with the
    # sequential executor's states too (compression keeps each client's residual)
    seq, seq_state, _ = _run("sequential", eval__clients=False, **overrides)
    vec, vec_state, _ = _run("vectorized", eval__clients=False, **overrides)
    assert isinstance(vec.trainer, BatchingTrainer) and vec.trainer.batched_fits > 0
    assert vec.trainer.sequential_fits == 0
    assert _max_diff(seq_state, vec_state) < 1e-5
    for cid in seq.client_ids:
        a, b = seq.trainer.store.load(cid), vec.trainer.store.load(cid)
        assert a.keys() == b.keys()
        if overrides is TOPK and "compression_residual" in a:   # a client that trained
            assert _max_diff(a["compression_residual"], b["compression_residual"]) < 1e-5


def test_a_behaviour_the_executor_cannot_run_is_refused_when_the_course_is_built():
    # Ditto's personal model trains after the global one, on the trainer the plain fit left:
    # no batched result stands for that, so the vectorized executor refuses it in one line
    with pytest.raises(ConfigError) as err:
        Course(small_cfg(None, executor="vectorized", **DITTO)).build()
    message = str(err.value)
    assert "\n" not in message
    assert "executor vectorized" in message and "personalization ditto" in message
    assert "executors that can: sequential, processes, ray" in message


def test_measured_time_runs_sequentially_with_a_reason(caplog):
    # measured compute time needs each client's own training on the stopwatch, not a batch's
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        course, _, _ = _run("vectorized", time__mode="measured")
    assert not isinstance(course.trainer, BatchingTrainer)
    assert any("time.mode=measured" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("n, bs, epoch, offset", [(10, 10, 0, 0), (10, 10, 3, 10), (7, 3, 1, 6),
                                                  (7, 3, 2, 7), (5, 8, 0, 0)])
def test_the_vectorized_stream_gives_the_batch_streams_batches(n, bs, epoch, offset):
    from fedcore.kernel.contract import BatchStream
    from fedcore.execution.vectorized import _draw
    for steps in range(7):
        a = BatchStream(n, bs, 4, 9, epoch, offset)
        idx, sizes, end = _draw(n, bs, 4, 9, epoch, offset, steps, torch.Generator())
        expected = [a.next() for _ in range(steps)]
        assert len(idx) == steps and all(torch.equal(e, i) for e, i in zip(expected, idx))
        assert sizes == tuple(len(e) for e in expected)
        assert end == a.position()


def test_vectorized_results_carry_their_exact_encoded_size():
    # the engine computes one size per sample count; each must be the content's real size
    from fedcore.kernel.contract import FitResult
    from fedcore.scenarios.data import ClientData, Split
    from fedcore.wire.serialization import encoded_size
    course = Course(small_cfg(None, executor="vectorized", torch_threads=1, train__local_steps=1,
                              train__batch_size=2)).build()
    front = course.trainer
    jobs = []
    for k, cid in enumerate(course.client_ids):   # 2, 3, 4, ... samples: one group, several counts
        d = course.clients[cid].data
        jobs.append((cid, ClientData(Split(d.train.x[:2 + k], d.train.y[:2 + k]), d.val, d.test), {}))
    results = front.engine.fit_many(front._trainer, jobs, course.server.aggregator.broadcast(1), 1)
    assert all(r is not None for r in results)
    sized = [r[0] for r in results]
    assert all(r.content_size == encoded_size(r.content) for r in sized)
    assert len({r.content["num_samples"] for r in sized}) == len(jobs)
    r = sized[0]
    r.content = dict(r.content)          # a wrapper that replaces the content drops the size
    assert r.content_size is None
    assert FitResult({"num_samples": 3}, 1.0).content_size is None


class _PullToZero(Trainer):
    """A new algorithm (an extra gradient term lam * w) that offers its own vectorised form,
    without the executor knowing it."""

    lam = 0.3

    @torch.no_grad()
    def adjust_gradients(self):
        for p in self.params:
            p.grad.add_(p, alpha=self.lam)

    def vector_term(self):
        return _PullToZeroTerm(self)


class _PullToZeroTerm(VectorTerm):
    def adjust(self, ctx, name, grad, param):
        return grad.add(param, alpha=self.trainer.lam)


algorithms.register("_test_pull_to_zero", Algorithm(_PullToZero, Aggregator))


def test_a_new_algorithm_is_vectorised_through_its_own_vector_term():
    case = dict(algorithm__name="_test_pull_to_zero", train__local_steps=3)
    _, seq, seq_trace = _run("sequential", **case)
    course, vec, vec_trace = _run("vectorized", **case)
    assert course.trainer.batched_fits > 0 and course.trainer.sequential_fits == 0
    assert _max_diff(seq, vec) < 1e-5 and vec_trace == seq_trace
    _, fedavg, _ = _run("sequential", train__local_steps=3)
    assert _max_diff(seq, fedavg) > 1e-3      # the term is really applied


class _NoForm(Trainer):
    def vector_term(self):
        return None


def test_a_trainer_without_a_vectorised_form_runs_sequentially(caplog):
    algorithms.register("_test_no_form", Algorithm(_NoForm, Aggregator))
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        course = Course(small_cfg(None, executor="vectorized", algorithm__name="_test_no_form")).build()
    assert not isinstance(course.trainer, BatchingTrainer)
    assert any("no vectorised form" in r.getMessage() for r in caplog.records)


def test_the_vectorized_executor_imports_no_algorithm():
    import subprocess
    import sys
    code = ("import sys, fedcore.execution.vectorized, fedcore.execution.batching; "
            "print(sorted(m for m in sys.modules if m.startswith('fedcore.algorithms')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_vectorized_lstm_whose_bias_gradients_share_memory_equals_sequential():
    """torch hands an LSTM's two bias gradients back as one tensor: the engine must not write
    the new parameters into it (it did, and bias_ih moved 180x too far, silently)."""
    over = dict(data__type="python_text", model__type="char_lstm_tiny", train__local_steps=3,
                train__optimizer__lr=0.5, federate__total_round_num=2)
    _, seq, _ = _run("sequential", **over)
    course, vec, _ = _run("vectorized", **over)
    assert course.trainer.batched_fits > 0 and course.trainer.sequential_fits == 0
    assert _max_diff(seq, vec) < 1e-5
    lstm = course.trainer.model.lstm
    assert lstm.bias_ih_l0.data_ptr() != lstm.bias_hh_l0.data_ptr()
