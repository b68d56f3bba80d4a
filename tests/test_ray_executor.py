"""`executor: ray`: Ray actors train the clients and the course's numbers are the sequential
executor's, with client state carried across rounds; without Ray the key is exit 2 naming
the extra. The first course starts a local Ray (one CPU per usable core: 2 on the test
machines, no dashboard, a small object store), which serves every course after it. Starting
Ray is most of these tests' cost, and `pytest -n` would start one per worker that runs one of
them: the courses on a local Ray are one test, each checked as its own test would."""
import logging
import sys

import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.execution.procpool import usable_cores
from fedcore.run import main
from tests.conftest import skip_module_without, small_cfg

skip_module_without("ray")   # imported by the tests that run, not at collection (a second of CPU)
from fedcore.execution.ray_executor import _IDLE  # noqa: E402

pytestmark = pytest.mark.slow

TRACE_KEYS = ("round", "virtual_time", "bytes_up", "bytes_down", "num_updates")


@pytest.fixture(scope="module", autouse=True)
def leave_ray():
    """The first course starts a local Ray, the later ones reuse it and its actors; the
    module ends it."""
    try:
        yield
    finally:
        import ray
        ray.shutdown()


def _run(executor, **overrides):
    course = Course(small_cfg(None, executor=executor, torch_threads=1, **overrides)).build()
    course.run()
    trace = [tuple(r.get(k) for k in TRACE_KEYS) for r in course.monitor.records]
    return course, dict(course.server.aggregator.global_state), trace


def _no_address_run_starts_a_local_ray_and_leaves_its_actors_warm():
    import ray
    assert not ray.is_initialized()
    _, seq, _ = _run("sequential")
    course, par, _ = _run("ray", executor__ray__object_store_mb=80)
    assert ray.is_initialized() and ray.cluster_resources()["CPU"] == usable_cores()
    assert course.trainer.batched_fits > 0 and course.trainer.sequential_fits == 0
    assert all(torch.equal(seq[k], par[k]) for k in seq)
    engine = course.trainer.engine
    assert engine._actors == [] and len(_IDLE[engine._pool_key]) == usable_cores()


ALGORITHMS = {
    "fedavg": dict(federate__total_round_num=3),
    # sampling 3 of 6: clients come back after rounds away, with their control variates
    "scaffold": dict(algorithm__name="scaffold", train__local_steps=3,
                     federate__sample_client_num=3, federate__total_round_num=4),
    "feddyn": dict(algorithm__name="feddyn", algorithm__feddyn__alpha=0.3, train__local_steps=3,
                   federate__sample_client_num=3, federate__total_round_num=4),
    # inner AdamW moments and step counts live in each client's state (not plain tensors)
    # behaviours' wrappers of the fit run inside the actors: their courses install them too
    "ditto": dict(personalization__method="ditto", federate__total_round_num=3),
    "local_dp": dict(privacy__dp__mode="local", privacy__dp__noise_multiplier=0.5,
                     federate__total_round_num=3),
    "diloco": dict(algorithm__name="diloco", train__optimizer__type="adamw",
                   train__optimizer__lr=0.01, train__preserve_optimizer_state=True,
                   train__local_steps=3, federate__total_round_num=3),
}


def _ray_equals_sequential(algorithm, caplog):
    overrides = ALGORITHMS[algorithm]
    _, seq, seq_trace = _run("sequential", **overrides)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedcore.executor"):
        course, par, par_trace = _run("ray", executor__ray__object_store_mb=80, **overrides)
    engine = course.trainer.engine
    assert course.trainer.batched_fits > 0 and course.trainer.sequential_fits == 0
    assert sum(engine.clients_by_node.values()) == course.trainer.batched_fits
    assert seq.keys() == par.keys()
    assert max(float((seq[k].double() - par[k].double()).abs().max()) for k in seq) <= 1e-6
    assert par_trace == seq_trace          # same virtual times, bytes and updates per round
    assert "executor ray: round 1: clients" in caplog.text
    assert engine._actors == []            # given back at the end of the run
    assert len(engine._nodes) == usable_cores()     # one actor per CPU of the local Ray


def _ray_actors_draw_the_clients_own_dropout_masks():
    """Dropout draws from the client's own stream in an actor too (tests/test_random_layers.py
    checks the other executors)."""
    over = dict(torch_threads=1, model__type="mlp", model__hidden=[9], model__mlp_dropout=0.3,
                train__local_steps=3, federate__sample_client_num=4, federate__total_round_num=2)
    results = {}
    for executor in ("sequential", "ray"):
        course = Course(small_cfg(None, executor=executor, executor__ray__object_store_mb=80,
                                  **over)).build()
        summary = course.run()
        results[executor] = (summary, dict(course.server.aggregator.global_state))
    assert results["ray"][0]["batched_fits"] == 8 and results["ray"][0]["sequential_fits"] == 0
    seq, par = results["sequential"][1], results["ray"][1]
    assert all(torch.equal(seq[k], par[k]) for k in seq)


def test_courses_on_one_local_ray_equal_their_sequential_runs(caplog):
    """Each check below was a test of its own; a failing one is named, the others still run."""
    checks = {"a run with no address starts a local Ray and leaves its actors warm":
              _no_address_run_starts_a_local_ray_and_leaves_its_actors_warm}
    checks.update({f"ray equals sequential [{a}]": (lambda a=a: _ray_equals_sequential(a, caplog))
                   for a in sorted(ALGORITHMS)})
    checks["ray actors draw the clients' own dropout masks"] = \
        _ray_actors_draw_the_clients_own_dropout_masks
    failed = {}
    for name, check in checks.items():
        try:
            check()
        except AssertionError as e:
            failed[name] = e
    assert not failed, "\n".join(f"{name}: {e}" for name, e in failed.items())


def test_ray_falls_back_when_the_data_cannot_be_rebuilt(caplog):
    from fedcore.scenarios.data import build_federated_data
    cfg = small_cfg(None, executor="ray")
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        course = Course(cfg).build(build_federated_data(cfg))
    assert "not made from the config" in caplog.text
    assert course.trainer.__class__.__name__ != "BatchingTrainer"


def test_ray_missing_is_exit_2_naming_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)      # `import ray` now fails
    rc = main(["--cfg", "scenarios/quickstart.yaml", "executor=ray", "federate.total_round_num=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "fedcore[ray]" in err[0] and "executor: ray" in err[0]
