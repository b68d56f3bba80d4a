"""FedRep and pFedMe as whole courses: the processes executor gives the sequential numbers and
personal states, the vectorized one runs them sequentially and says why, and a course resumed
from a checkpoint continues with every client's head or personal model."""
import json
import logging

import pytest
import torch

from fedcore.execution.batching import BatchingTrainer
from fedcore.runtime.course import Course
from tests.conftest import small_cfg

CASES = {"fedrep": dict(algorithm__fedrep__head_steps=2),
         "pfedme": dict(algorithm__pfedme__inner_steps=2)}


COMMON = dict(model__type="mlp", model__hidden=[6], train__local_steps=2,
              federate__sample_client_num=4, federate__total_round_num=3)


def _run(algorithm, executor):
    cfg = small_cfg(None, algorithm__name=algorithm, executor=executor, executor_workers=2,
                    **COMMON, **CASES[algorithm])
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


@pytest.mark.parametrize("algorithm", sorted(CASES))
def test_a_resumed_course_continues_with_the_personal_state(tmp_path, algorithm):
    common = dict(algorithm__name=algorithm, **COMMON, **CASES[algorithm])
    full = Course(small_cfg(tmp_path / "full", checkpoint__every=1, **common))
    full.run()
    resumed = Course(small_cfg(tmp_path / "resumed", **common,
                               resume_from=str(tmp_path / "full" / "checkpoints" / "round_1.pt")))
    resumed.run()
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    keys = ("round", "test_acc", "client_test_acc_mean", "client_test_acc_std", "bytes_up")
    assert [[r.get(k) for k in keys] for r in rows] == [[r.get(k) for k in keys] for r in again]
    for cid in full.client_ids:
        assert _same_tree(full.trainer.store.load(cid), resumed.trainer.store.load(cid))


@pytest.mark.parametrize("overrides", [dict(algorithm__name="fedrep", **CASES["fedrep"]),
                                       dict(algorithm__name="pfedme", **CASES["pfedme"]),
                                       dict(personalization__method="ditto"),
                                       dict(algorithm__name="fedavg")])
def test_the_last_line_leads_with_the_personalized_accuracy(tmp_path, capsys, overrides):
    """For a personalized course the global model's accuracy is not the method's: the last line
    gives the mean over the clients' own models (the last record's client_test_acc_mean) first."""
    course = Course(small_cfg(tmp_path / "out", **{**COMMON, **overrides})).build()
    assert course.check_or_run(False) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    last = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()][-1]
    if overrides.get("algorithm__name") == "fedavg":
        assert f"final test_acc {last['test_acc']:.4f};" in line and "personalized" not in line
    else:
        assert (f"final personalized test_acc {last['client_test_acc_mean']:.4f} (mean of the clients' own "
                f"models), global model's test_acc {last['test_acc']:.4f};") in line
