"""The deployed server's derived deadline per stage of a round (handlers/deployment.py,
`time_stages`), as secure aggregation's five stages use it, on the virtual clock."""
import pytest

from fedcore.handlers import deployment
from fedcore.kernel.message import SERVER_ID
from tests.test_deploy_handlers import _Msg, _kept_until, _timed_server

# secure aggregation's stages: request -> reply (handlers/secure_aggregation.py)
STAGES = [("models", "secagg_public_keys"), ("secagg_neighbour_keys", "secagg_encrypted_shares"),
          ("secagg_routed_shares", "secagg_masked_input"),
          ("secagg_consistency_check", "secagg_survivor_signature"),
          ("secagg_unmask_request", "secagg_unmask_shares")]


def _stage(server, request: str, reply: str, sent_at: float, replies: dict[int, float], waiting=()) -> None:
    """One stage of round `server.round`: `request` sent to every client at `sent_at`, each in
    `replies` answering after its number of seconds; the server then waits for `waiting`."""
    for cid in [*replies, *waiting]:
        deployment.note_traffic(server, _Msg(request, SERVER_ID, server.round), cid, sent_at)
    for cid, took in replies.items():
        deployment.note_traffic(server, _Msg(reply, cid, server.round), SERVER_ID, sent_at + took)
    server.selected, server.buffer = set(waiting), list(replies)


def _secure_server():
    course, server = _timed_server()   # heartbeat timeout 10 s, factor 5, 0.2 s of transfer
    deployment.time_stages(server, STAGES)
    return course, server


def test_each_stage_is_timed_on_its_own_replies_not_on_training():
    course, server = _secure_server()
    # training took 40-60 s: the model's stage alone would allow max(10, 5 x 40) + 0.2 = 200.2 s
    _stage(server, *STAGES[0], 0.0, {1: 40.0, 2: 50.0, 3: 60.0})
    at = 60.0
    for request, reply in STAGES[1:4]:
        _stage(server, request, reply, at, {1: 0.2, 2: 0.3, 3: 0.4})
        at += 1.0
    # client 3 withholds its unmask answer: the others answered this stage in 0.1 s and 0.3 s,
    # whose lower median is 0.1 s: max(10, 5 x 0.1) + 0.2 = 10.2 s from the unmask request
    server.now = at
    _stage(server, *STAGES[4], at, {1: 0.1, 2: 0.3}, waiting=(3,))
    _kept_until(server, at, 10.2)
    assert course.raised == [("all_received", server.now)]   # the stage completes with the others
    (drop,) = course.monitor.extra_summary["dropped"]
    assert drop["clients"] == [3] and drop["reason"] == ("no reply to secagg_unmask_request within the "
                                                         "derived deadline of 10.2s (distribute.deadline_factor)")
    # it answered the model's stage this round: sampled again next round, not benched
    assert deployment.benched(server) == set()
    # the model's stage keeps its own times: the least deadline (evaluations wait for it) is
    # measured on training, max(10, 5 x 50) + 0.2 for client 1 (others: 50 s and 60 s)
    assert deployment._deadline(server, 1, "models") == 250.2
    assert deployment.least_deadline(server) == 200.2


def test_a_client_silent_at_the_models_stage_is_benched_until_it_answers():
    course, server = _secure_server()
    _stage(server, *STAGES[0], 0.0, {1: 3.0, 2: 4.0}, waiting=(3,))
    server.now = 4.0
    _kept_until(server, 0.0, 15.2)     # max(10, 5 x 3) + 0.2, as in a plain round
    assert deployment.benched(server) == {3}
    assert "derived round deadline of 15.2s" in course.monitor.extra_summary["dropped"][0]["reason"]
    # a plain update is no reply in this course; its late keys are
    deployment.note_traffic(server, _Msg("updates", 3, server.round), SERVER_ID, 20.0)
    assert deployment.benched(server) == {3}
    deployment.note_traffic(server, _Msg("secagg_public_keys", 3, server.round), SERVER_ID, 20.0)
    assert deployment.benched(server) == set()


def test_a_stage_nobody_answered_yet_waits_for_the_ceiling_and_a_fixed_deadline_applies_per_stage():
    course, server = _secure_server()
    course.cfg = course.cfg.with_overrides(distribute__max_round_deadline=30.0)
    _stage(server, *STAGES[0], 0.0, {1: 1.0, 2: 1.0, 3: 1.0})
    server.now = 2.0
    _stage(server, *STAGES[1], 2.0, {}, waiting=(1, 2, 3))   # no reply time for this stage at all
    _kept_until(server, 2.0, 30.2)
    course.cfg = course.cfg.with_overrides(distribute__round_deadline=5.0)
    server.round += 1
    server.now = 50.0
    _stage(server, *STAGES[0], 50.0, {1: 1.0, 2: 1.0, 3: 1.0})
    _stage(server, *STAGES[2], 51.0, {1: 0.5}, waiting=(2, 3))
    _kept_until(server, 51.0, 5.0)    # from the stage's request, not from the round's start
    assert course.monitor.extra_summary["dropped"][-1]["reason"] == \
        "no reply to secagg_routed_shares within distribute.round_deadline=5s"
    assert deployment.benched(server) == set()


def test_a_stage_message_larger_than_the_model_widens_the_slow_link_allowance():
    # a float32 model of 250 entries (1000 bytes) is masked as 251 int64s: 2008 bytes each way
    # at 10,000 B/s is 0.4016 s where the model's 1000 bytes would give 0.2 s
    course, server = _timed_server()
    deployment.time_stages(server, STAGES, nbytes=8 * 251)
    _stage(server, *STAGES[0], 0.0, {1: 1.0, 2: 1.0, 3: 1.0})
    server.now = 2.0
    _stage(server, *STAGES[2], 2.0, {1: 0.1, 2: 0.1}, waiting=(3,))
    _kept_until(server, 2.0, 10.4016)   # max(10, 5 x 0.1) + 0.4016


def test_a_round_must_begin_with_the_models_stage():
    _course, server = _timed_server()
    with pytest.raises(ValueError, match="first stage"):
        deployment.time_stages(server, STAGES[1:])


def test_secure_aggregation_times_these_stages():
    from tests.conftest import need_extra
    need_extra("secagg")
    from fedcore.handlers import secure_aggregation as secagg
    assert [(secagg.REQUESTS[stage], reply) for stage, reply, _ in secagg.STAGES] == STAGES
