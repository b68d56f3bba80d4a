"""FedRep and pFedMe under the other executors: the processes executor gives the sequential
numbers and personal states; the vectorized one runs them sequentially and says why."""
import logging

import pytest
import torch

from fedcore.batching import BatchingTrainer
from fedcore.course import Course
from tests.conftest import small_cfg

CASES = {"fedrep": dict(algorithm__fedrep__head_steps=2),
         "pfedme": dict(algorithm__pfedme__inner_steps=2)}


def _run(algorithm, executor):
    cfg = small_cfg(None, algorithm__name=algorithm, executor=executor, executor_workers=2,
                    model__type="mlp", model__hidden=[6], train__local_steps=2,
                    federate__sample_client_num=4, federate__total_round_num=3, **CASES[algorithm])
    course = Course(cfg).build()
    course.run()
    return course


def _same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_processes_give_the_sequential_models_and_personal_states(algorithm):
    seq, par = _run(algorithm, "sequential"), _run(algorithm, "processes")
    assert isinstance(par.trainer, BatchingTrainer) and par.trainer.batched_fits > 0
    assert _same_tree(seq.server.aggregator.global_state, par.server.aggregator.global_state)
    for cid in seq.client_ids:
        assert _same_tree(seq.trainer.store.load(cid), par.trainer.store.load(cid))
    assert seq.monitor.records[-1]["client_test_acc_mean"] == par.monitor.records[-1]["client_test_acc_mean"]


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_vectorized_runs_them_sequentially_with_a_reason(caplog, algorithm):
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        course = _run(algorithm, "vectorized")
    assert not isinstance(course.trainer, BatchingTrainer)
    trainer = {"fedrep": "FedRepTrainer", "pfedme": "PFedMeTrainer"}[algorithm]
    assert [m for m in (r.getMessage() for r in caplog.records)
            if f"trainer {trainer} changes" in m and m.endswith("running sequentially")]
