"""Course options: early stopping, shared vs local parameters, sampling."""
import json

import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg


def test_early_stop_after_patience_evaluations_without_improvement(tmp_path):
    # lr so small that accuracy cannot change: the first evaluation is the best
    cfg = small_cfg(tmp_path, federate__total_round_num=10, early_stop__patience=2,
                    train__optimizer__lr=1e-12)
    summary = Course(cfg).run()
    assert summary["rounds"] == 3 and summary["stopped_by"] == "early_stop"


def test_share_params_keeps_the_rest_local(tmp_path):
    cfg = small_cfg(tmp_path, federate__share_params=["*.weight"], federate__total_round_num=2)
    course = Course(cfg).build()
    sent = []
    original = course.comm.send
    course.comm.send = lambda msg: (sent.append(msg), original(msg))
    course.run()
    updates = [m for m in sent if m.msg_type == "updates"]
    models = [m for m in sent if m.msg_type == "models"]
    assert updates and all(set(m.content["model"]) == {"1.weight"} for m in updates + models)
    # each client's bias stays its own and differs across clients after local training
    biases = [course.store.load(c)["local_params"]["1.bias"] for c in course.client_ids]
    assert not torch.equal(biases[0], biases[1])
    # the global bias never moves from its initial value
    init = course.server.model.state_dict()["1.bias"]
    assert torch.equal(course.server.aggregator.global_state["1.bias"], init)


def test_sample_client_rate_picks_that_many_per_round(tmp_path):
    Course(small_cfg(tmp_path, federate__sample_client_rate=0.5, federate__total_round_num=3)).run()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_updates"] for r in rows] == [3, 3, 3]
