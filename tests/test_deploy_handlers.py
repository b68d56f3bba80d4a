"""The deployment's server handlers, run on the virtual clock with a recording course."""
import logging

import torch

from fedcore.deployment.deployed_resume import LISTED
from fedcore.handlers import deployment
from fedcore.kernel.message import SERVER_ID
from fedcore.runtime.monitor import Monitor
from fedcore.kernel.scheduler import Scheduler
from fedcore.kernel.worker import HandlerTable, Server
from tests.conftest import small_cfg


class _Course:
    def __init__(self, **cfg):
        self.cfg = small_cfg(None, **cfg)
        self.scheduler = Scheduler()
        self.monitor = Monitor(None)
        self.log = logging.getLogger("test")
        self.server_table = HandlerTable("server")
        self.live = [1, 2, 3]
        self.raised = []

    @property
    def client_ids(self):
        return self.live


def _server(**cfg):
    course = _Course(**cfg)
    deployment.install(course)
    for event in ("all_received", "all_joined_in"):
        course.server_table.register(event, lambda s, _e, ev=event: course.raised.append((ev, s.now)))
    server = Server(course.server_table, course)
    server.joined, server.started, server.finished = {1, 2, 3}, True, False
    server.round, server.selected, server.buffer = 4, {1, 2, 3}, []
    return course, server


def _timed_server():
    """A server for the deadline tests: heartbeat timeout 10 s, deadline factor 5, and a
    1000-byte model (its transfer down and up at the default 10,000 B/s adds 0.2 s)."""
    course, server = _server(distribute__heartbeat_timeout=10.0, distribute__deadline_factor=5.0)
    course.server = server
    server.aggregator = type("A", (), {"global_state": {"w": torch.zeros(250)}})()
    return course, server


def _kept_until(server, start: float, deadline: float) -> None:
    """The sampled clients are waited for until `deadline` seconds after `start`, then dropped."""
    waiting = set(server.selected)
    server.now = start + deadline - 1e-6   # (float sums: just before it)
    server.trigger("round_check")
    assert server.selected == waiting
    server.now = start + deadline + 0.1
    server.trigger("round_check")
    assert server.selected == set()


def test_lost_client_is_dropped_and_the_round_completes_with_the_others():
    course, server = _server()
    server.buffer = ["update from 1", "update from 3"]
    server.selected = {2}
    server.trigger("client_lost", {"client_id": 2, "reason": "no heartbeat"})
    assert server.selected == set() and course.raised == [("all_received", 0.0)]
    assert course.monitor.extra_summary["dropped"] == [
        {"round": 4, "clients": [2], "reason": "client 2 no heartbeat"}]
    assert course.monitor.extra_summary["lost_clients"][0]["client"] == 2


def test_round_with_no_one_left_starts_again_and_unsampled_losses_change_nothing():
    course, server = _server()
    server.trigger("client_lost", {"client_id": 3, "reason": "left"})
    assert server.selected == {1, 2} and course.raised == []
    server.selected = {1}
    server.trigger("client_lost", {"client_id": 1, "reason": "left"})
    assert course.raised == [("all_joined_in", 0.0)]  # no update in hand: sample the round again


def test_losses_before_the_start_or_after_the_finish_are_not_faults():
    course, server = _server()
    server.started = False
    server.trigger("client_lost", {"client_id": 1, "reason": "restarted"})
    server.started, server.finished = True, True
    server.trigger("client_lost", {"client_id": 2, "reason": "left: finished"})
    assert server.selected == {1, 2, 3} and "lost_clients" not in course.monitor.extra_summary


def test_round_deadline_drops_the_clients_that_have_not_replied():
    course, server = _server(distribute__round_deadline=5.0)
    server.buffer = ["update from 1"]
    server.selected = {2, 3}
    for t in (0.0, 3.0, 5.0):        # the round is first seen at 0; 5 s later is not yet past
        server.now = t
        server.trigger("round_check")
    assert course.raised == [] and server.selected == {2, 3}
    server.now = 5.5
    server.trigger("round_check")
    assert server.selected == set() and course.raised == [("all_received", 5.5)]
    assert "round_deadline=5s" in course.monitor.extra_summary["dropped"][0]["reason"]


def test_min_clients_start_after_the_join_timeout():
    course, server = _server(distribute__min_clients=2, distribute__join_timeout=10.0,
                             distribute__heartbeat_interval=1.0)
    server.started, course.live = False, [2]
    server.trigger("start")
    course.scheduler.run(until=10.5)
    assert course.raised == [] and not server.started   # one of two: keep waiting
    course.live = [2, 3]
    course.scheduler.run(until=11.5)
    assert server.started and course.raised == [("all_joined_in", 11.0)]


def _async_course(tmp_path):
    """A built async course (2 of 3 clients in flight) with the deployment's handlers added."""
    from fedcore.runtime.course import Course
    course = Course(small_cfg(tmp_path, federate__client_num=3, federate__sample_client_num=2,
                              asyn__use=True, asyn__min_received_num=1,
                              asyn__broadcast_manner="after_receiving")).build()
    deployment.install(course)
    server = course.server
    server.started = True
    server.in_flight = {1: (1, 0.0), 2: (1, 0.0)}
    return course, server


def test_async_lost_client_in_flight_is_released_and_replaced_by_an_idle_one(tmp_path):
    course, server = _async_course(tmp_path)
    course.client_ids = [1, 3]  # in deployment: the clients still connected
    server.trigger("client_lost", {"client_id": 2, "reason": "no heartbeat"})
    assert set(server.in_flight) == {1, 3} and server.in_flight[3][0] == server.round
    assert server.stats.presumed_lost == 1
    assert course.monitor.extra_summary["lost_clients"][0]["client"] == 2
    # a client lost while idle changes nothing in flight
    course.client_ids = [1]
    server.in_flight.pop(3)
    server.trigger("client_lost", {"client_id": 3, "reason": "left"})
    assert set(server.in_flight) == {1} and server.stats.presumed_lost == 1


def test_async_round_with_everyone_lost_restarts_with_the_clients_that_return(tmp_path):
    course, server = _async_course(tmp_path)
    server.in_flight = {}
    course.client_ids = []
    server.trigger("round_check")
    assert server.in_flight == {}
    course.client_ids = [2]  # a client reconnects
    server.trigger("round_check")
    assert set(server.in_flight) == {2}


def _round(server, sent_at: float, replies: dict[int, float], waiting=()) -> None:
    """Round `server.round`: models sent to `replies`' clients and `waiting` at `sent_at`; each
    client in `replies` answered after its number of seconds."""
    for cid in [*replies, *waiting]:
        deployment.note_traffic(server, _Msg("models", SERVER_ID, server.round), cid, sent_at)
    for cid, took in replies.items():
        deployment.note_traffic(server, _Msg("updates", cid, server.round), SERVER_ID, sent_at + took)
    server.selected, server.buffer = set(waiting), [f"u{c}" for c in replies]


class _Msg:
    def __init__(self, msg_type, sender, round_):
        self.msg_type, self.sender, self.round = msg_type, sender, round_


def test_derived_deadline_is_the_others_median_reply_time_times_the_factor():
    course, server = _timed_server()
    server.now = 3.0
    _round(server, 0.0, {1: 3.0, 2: 4.0}, waiting=(3, 4))
    # clients 3 and 4 have no reply time of their own: the lower median of {3, 4} s is 3 s;
    # deadline: max(10, 5 x 3) + 2 x 1000 bytes / 10000 bytes/s = 15.2 s from the models sent
    _kept_until(server, 0.0, 15.2)
    assert course.raised == [("all_received", server.now)]
    assert "derived round deadline of 15.2s" in course.monitor.extra_summary["dropped"][0]["reason"]
    assert deployment.benched(server) == {3, 4}    # not sampled again until they show life


def test_a_clients_own_lateness_never_lengthens_its_own_deadline():
    course, server = _timed_server()
    _round(server, 0.0, {1: 3.0, 2: 4.0, 4: 2.0, 3: 15.0})   # client 3 replied just in time
    server.round += 1
    server.now = 100.0
    _round(server, 100.0, {1: 3.0, 2: 4.0, 4: 2.0}, waiting=(3,))
    # client 3's own 15 s are left out: the lower median of {2, 3, 4} s is 3 s, as before it
    # was late: max(10, 5 x 3) + 0.2
    _kept_until(server, 100.0, 15.2)
    # a slow minority moves no one's deadline past the honest clients' times: client 1's would
    # be the lower median of {2, 4, 15} = 4 s: max(10, 5 x 4) + 0.2
    assert deployment._deadline(server, 1) == 20.2


def test_the_derived_deadline_has_a_ceiling_and_is_the_ceiling_before_anyone_replied():
    course, server = _timed_server()
    course.cfg = course.cfg.with_overrides(distribute__max_round_deadline=30.0)
    server.now = 1.0
    _round(server, 0.0, {}, waiting=(1, 2, 3))
    _kept_until(server, 0.0, 30.2)            # no reply time at all: the ceiling, + 0.2
    server.round += 1
    _round(server, 50.0, {1: 100.0, 2: 200.0}, waiting=(3,))
    _kept_until(server, 50.0, 30.2)           # min(30, max(10, 5 x 100)) + 0.2
    assert [e for e, _t in course.raised] == ["all_joined_in", "all_received"]


def test_a_benched_client_comes_back_with_an_update_or_a_new_processs_join_only():
    course, server = _timed_server()
    deployment.benched(server).update({2, 3})
    deployment.note_traffic(server, _Msg("metrics", 2, 4), SERVER_ID, 1.0)
    deployment.note_traffic(server, _Msg("updates", 2, 3), SERVER_ID, 1.0)   # a late one
    # a join sent again on the session already in (a hung client with heartbeats on): still
    # benched, or it would be sampled and waited for a deadline more every round
    deployment.note_traffic(server, _Msg("join_in", 3, 0), SERVER_ID, 1.0)
    assert deployment.benched(server) == {3}
    deployment.new_session(server, 3)                                        # a restarted client
    deployment.note_traffic(server, _Msg("join_in", 3, 0), SERVER_ID, 1.0)
    assert deployment.benched(server) == set()


def test_a_process_back_on_its_lost_session_leaves_the_bench_and_each_return_is_listed():
    # Client 2 was benched, then its session was lost (silent past heartbeat_timeout: a model
    # sent meanwhile went with the session) and the same process came back on its session id:
    # it will not re-join, and no late update of it is coming, so only its return can bring it
    # back. Client 3 restarted: its new process's join brings it back, as before.
    course, server = _timed_server()
    deployment.benched(server).update({2, 3})
    deployment.returned(server, 2)
    assert deployment.benched(server) == {3}
    deployment.new_session(server, 3)
    deployment.note_traffic(server, _Msg("join_in", 3, 0), SERVER_ID, 1.0)
    assert deployment.benched(server) == set()
    assert course.monitor.extra_summary["joined_during_course"] == [
        {"client": 2, "round": 4, "how": "session back"}, {"client": 3, "round": 4, "how": "new process joined"}]
    server.started = False                                   # before the course: nothing to list
    deployment.returned(server, 1)
    assert course.monitor.extra_summary["joined_during_course_total"] == 2


def test_lost_lists_stay_bounded():
    course, server = _server()
    for k in range(LISTED + 30):
        server.trigger("client_lost", {"client_id": 1 + k % 3, "reason": "flapping"})
    extra = course.monitor.extra_summary
    assert len(extra["lost_clients"]) == LISTED and extra["lost_clients_total"] == LISTED + 30


def test_a_round_with_no_client_to_sample_waits_instead_of_running_the_course_empty(caplog):
    # Every client benched for a missed deadline (or gone): the deployed course's candidates are
    # none. The round must wait for round_check to start it again, not aggregate nothing and
    # start the next round inside this one (which ran 239 empty rounds, then RecursionError).
    from fedcore.handlers import sync
    from fedcore.runtime.course import Course
    course = Course(small_cfg(None, federate__total_round_num=1000)).build()
    server = course.server
    server.round = 4
    course.client_ids = []
    with caplog.at_level(logging.WARNING):
        sync.start_round(server)
    assert server.round == 4 and server.selected == set() and not server.finished
    assert "round 4: no client to sample" in caplog.text
    # an empty sample among candidates (Poisson sampling) still aggregates nothing and moves on
    course.client_ids = [1, 2]
    real, draws = server.sampler.sample, []

    def first_empty(k, candidates):
        draws.append(candidates)
        return [] if len(draws) == 1 else real(k, candidates)
    server.sampler.sample = first_empty
    sync.start_round(server)
    assert server.round == 5 and server.selected and len(draws) == 2   # round 4 empty, round 5 sampled


def test_a_long_run_of_empty_samples_takes_turns_instead_of_nesting():
    # A Poisson rate far below one client per round draws thousands of empty samples in a row;
    # each round aggregates nothing and starts the next. Nested, one call per round, 3,000 of
    # them pass Python's recursion limit (1,000 frames); in turns, the course just moves on.
    from fedcore.handlers import sync
    from fedcore.runtime.course import Course
    empty = 3000
    course = Course(small_cfg(None, federate__total_round_num=empty + 10, eval__freq=10_000)).build()
    server = course.server
    real, draws = server.sampler.sample, []

    def empty_first(k, candidates):
        draws.append(k)
        return [] if len(draws) <= empty else real(k, candidates)
    server.sampler.sample = empty_first
    sync.start_round(server)
    assert len(draws) == empty + 1 and server.round == empty + 1 and server.selected
    assert not server.finished
