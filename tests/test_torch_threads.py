"""`torch_threads: auto` (the default): every usable core for a simulation that trains in its
own process with a local step of at least AUTO_THREADS_MFLOP, one thread otherwise. The step is
counted (forward and backward, fedcore.execution.executor.step_mflop) without touching the
course: no buffer, gradient or random draw changes."""
import pytest
import torch

import fedcore.execution.executor as executor
from fedcore.execution.executor import apply_torch_threads, close_executor, step_mflop, usable_cores
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.course import Course
from tests.conftest import small_cfg

# small_cfg: synthetic inputs of dim 8, 3 classes, batches of 10, logistic regression
DIM, CLASSES, BATCH = 8, 3, 10


def test_a_logistic_regressions_step_is_4_b_d_c_flop():
    # forward x @ W^T: 2*b*d*c; backward, the weight's gradient g^T @ x: 2*b*d*c (the inputs
    # need none; bias additions and sums are not counted as matrix work)
    course = Course(small_cfg(None, torch_threads=1)).build()
    assert step_mflop(course) == pytest.approx(4 * BATCH * DIM * CLASSES / 1e6, rel=0, abs=1e-12)


def test_counting_the_step_changes_nothing_in_the_course():
    course = Course(small_cfg(None, torch_threads=1, model__type="mlp", model__mlp_dropout=0.5)).build()
    model = course.trainer.model
    model.train()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert step_mflop(course) > 0
    assert torch.equal(torch.get_rng_state(), rng)       # dropout drew nothing from the course's
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())


@pytest.mark.skipif(usable_cores() < 2, reason="needs two usable cores")
def test_auto_gives_a_large_step_every_core_and_a_small_one_a_single_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    mflop = 4 * BATCH * DIM * CLASSES / 1e6
    monkeypatch.setattr(executor, "AUTO_THREADS_MFLOP", mflop / 2)     # this step counts as large
    Course(small_cfg(None)).build()
    assert torch.get_num_threads() == 2
    Course(small_cfg(None, executor="vectorized")).build()
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(executor, "AUTO_THREADS_MFLOP", mflop * 2)     # and now as small
    Course(small_cfg(None)).build()
    assert torch.get_num_threads() == 1


@pytest.mark.skipif(usable_cores() < 2, reason="needs two usable cores")
def test_auto_is_one_thread_where_processes_share_the_machine(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(executor, "AUTO_THREADS_MFLOP", 0.0)
    torch.set_num_threads(2)
    apply_torch_threads(small_cfg(None))          # a deployed server or client: no course given
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    course = Course(small_cfg(None, executor="processes", executor_workers=2)).build()
    try:
        assert torch.get_num_threads() == 1
    finally:
        close_executor(course)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")    # the user's bound holds
    Course(small_cfg(None)).build()
    assert torch.get_num_threads() == 1


def test_the_key_takes_auto_a_number_or_null_and_says_what_else():
    assert small_cfg()["torch_threads"] == "auto"
    assert small_cfg(torch_threads=3)["torch_threads"] == 3
    assert small_cfg(torch_threads=None)["torch_threads"] is None
    with pytest.raises(ConfigError, match=r"^torch_threads: expected int or 'auto', got str 'autoo'$"):
        small_cfg(torch_threads="autoo")
    with pytest.raises(ConfigError, match=r"^torch_threads: must be > 0, got 0$"):
        small_cfg(torch_threads=0)


@pytest.mark.skipif(usable_cores() < 2, reason="needs two usable cores")
def test_auto_keeps_one_thread_for_a_trainer_without_a_torch_model(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(executor, "AUTO_THREADS_MFLOP", 0.0)
    course = Course(small_cfg(None, **{"train.backend": "numpy", "train.shuffle": "numpy"})).build()
    assert step_mflop(course) is None and torch.get_num_threads() == 1
