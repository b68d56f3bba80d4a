"""Time-budgeted local work: each client takes the steps its device finishes in the budget;
with equal devices FedNova still equals FedAvg exactly, with unequal ones it reports each
client's own factor; the vectorized executor falls back; conflicting keys are refused."""

import pytest
import torch

from fedcore.algorithms.fednova import norm_factor
from fedcore.algorithms.local_budget import budget_steps
from fedcore.execution.batching import BatchingTrainer
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg

SLOW_AND_FAST = {"type": "lognormal", "median": 100, "sigma": 0.7}


def test_budget_steps_by_hand():
    assert budget_steps(0.5, 100.0, 24, 10) == 5          # 0.5 s x 100 evals/s / 10 per step
    assert budget_steps(0.5, 100.0, 4, 10) == 12          # a step costs only the 4 samples held
    assert budget_steps(0.5, 100.0, 24, 10, grad_accum=2) == 2
    assert budget_steps(0.01, 100.0, 24, 10) == 1         # at least one step


def _spied(course):
    seen = []
    fit = course.trainer.fit

    def spy(cid, data, received, round_):
        result = fit(cid, data, received, round_)
        seen.append((cid, result))
        return result
    course.trainer.fit = spy
    return seen


def test_each_client_takes_the_steps_its_device_finishes_in_the_budget():
    course = Course(small_cfg(None, algorithm__name="fednova", train__local_time_budget=0.3,
                              train__optimizer__momentum=0.5, time__profiles=SLOW_AND_FAST)).build()
    seen = _spied(course)
    course.run()
    factors = set()
    for cid, result in seen:
        speed = course.timing.profile(cid).compute_speed
        n = len(course.data.clients[cid].train)
        steps = budget_steps(0.3, speed, n, 10)
        assert float(result.content["nova"]["a"]) == pytest.approx(norm_factor(steps, 0.5), abs=1e-12)
        assert result.work <= max(0.3 * speed, 10) + 1e-9   # modeled compute within the budget
        factors.add(steps)
    assert len(factors) > 1                                   # the devices really differ


def _final(tmp_path, name, **keys):
    Course(small_cfg(tmp_path / name, model__dtype="float64", eval__clients=False,
                     train__local_time_budget=0.3, **keys)).run()
    return torch.load(tmp_path / name / "final_model.pt", weights_only=True)


def test_fednova_equals_fedavg_on_equal_devices_and_differs_on_unequal_ones(tmp_path):
    nova = _final(tmp_path, "nova", algorithm__name="fednova")
    avg = _final(tmp_path, "avg")
    assert all(torch.equal(nova[k], avg[k]) for k in nova)     # constant profile: equal steps
    nova = _final(tmp_path, "nova2", algorithm__name="fednova", time__profiles=SLOW_AND_FAST)
    avg = _final(tmp_path, "avg2", time__profiles=SLOW_AND_FAST)
    assert not torch.equal(nova["1.weight"], avg["1.weight"])


def test_the_vectorized_executor_refuses_it_and_worker_processes_give_the_same_numbers():
    # the budget changes each client's step count: no batched result of the plain fit stands
    # for that, so the vectorized executor refuses the course in one line; worker processes
    # run the trainer's whole fit, budget included
    keys = dict(train__local_time_budget=0.3, time__profiles=SLOW_AND_FAST, torch_threads=1)
    with pytest.raises(ConfigError, match="executor vectorized cannot run behaviour "
                                          "train.local_time_budget"):
        Course(small_cfg(None, executor="vectorized", **keys)).build()
    seq = Course(small_cfg(None, **keys)).build()
    seq.run()
    par = Course(small_cfg(None, executor="processes", executor_workers=2, **keys)).build()
    par.run()
    assert isinstance(par.trainer, BatchingTrainer) and par.trainer.batched_fits > 0
    a, b = seq.server.aggregator.global_state, par.server.aggregator.global_state
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("keys, match", [
    (dict(algorithm__name="diloco", train__local_steps=2, train__optimizer__type="adamw",
          train__preserve_optimizer_state=True), "train.local_time_budget: algorithm diloco"),
    (dict(algorithm__name="fednova", algorithm__fednova__straggler_fraction=0.5),
     "algorithm.fednova.straggler_fraction"),
    (dict(algorithm__name="fedprox", algorithm__fedprox__straggler_fraction=0.5),
     "algorithm.fedprox.straggler_fraction"),
])
def test_conflicting_step_counts_are_refused(keys, match):
    with pytest.raises(ConfigError, match=match):
        small_cfg(train__local_time_budget=0.3, **keys)
