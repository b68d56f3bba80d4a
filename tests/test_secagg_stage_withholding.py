"""A secure-aggregation client that withholds its answer to one of the stages the deployed test
(tests/test_deploy_secagg_deadlines.py: the masked input and the unmask reply) does not cover:
its public keys, its encrypted shares, or its survivor signature. The project's client with
that one stage changed, in round 1 only, 4 clients (k = 3 neighbours, t = 2). At the stage's
timeout the round goes on without it and completes; it is summed again from round 2. Without
its keys or shares nobody masks with it, so round 1 sums the other three; a withheld
signature comes after its masked input, which is summed (t = 2 of its 3 holders rebuild its
self mask), so that course is the honest one."""
import logging

import pytest
import torch

from tests.conftest import need_extra, small_cfg

need_extra("secagg")

from fedcore.runtime.course import Course  # noqa: E402

BAD = 4
COURSE = dict(secure_aggregation__enabled=True, eval__clients=False, model__dtype="float64",
              federate__client_num=4, federate__total_round_num=3, secure_aggregation__stage_timeout=5.0)


def _course(out, event=None):
    course = Course(small_cfg(out, **COURSE)).build()
    if event is not None:
        reg = course.client_table.get(event)

        def stage(client, msg):
            if client.id == BAD and msg.round == 1:
                return None
            return reg.fn(client, msg)
        course.client_table.register(event, stage, sends=reg.sends)
    return course


@pytest.mark.parametrize("event, reply, summed", [
    ("receiving_models", "secagg_public_keys", [3, 4, 4]),
    ("receiving_secagg_neighbour_keys", "secagg_encrypted_shares", [3, 4, 4]),
    ("receiving_secagg_consistency_check", "secagg_survivor_signature", [4, 4, 4]),
], ids=["keys", "shares", "signature"])
def test_a_client_withholding_an_early_stage_or_its_signature_costs_one_stage_timeout(
        tmp_path, caplog, event, reply, summed):
    course = _course(tmp_path / "attacked", event)
    with caplog.at_level(logging.WARNING, logger="fedcore.secagg"):
        summary = course.run()
    assert summary["stopped_by"] == "max_rounds"
    assert [r["num_updates"] for r in course.monitor.records] == summed
    lines = [r.getMessage() for r in caplog.records if "within 5s" in r.getMessage()]
    assert lines == [f"secure aggregation: round 1: no {reply} from client(s) [{BAD}] within 5s; "
                     "going on without them"]
    assert 5.0 <= course.monitor.records[0]["virtual_time"] < 10.0   # one stage timeout, not more
    if summed[0] == 4:
        honest = _course(tmp_path / "honest")
        honest.run()
        for name, t in honest.server.aggregator.global_state.items():
            assert torch.equal(course.server.aggregator.global_state[name], t), name
