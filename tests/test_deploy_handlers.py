"""The deployment's server handlers, run on the virtual clock with a recording course."""
import logging

import torch

from fedcore.handlers import deployment
from fedcore.monitor import Monitor
from fedcore.scheduler import Scheduler
from fedcore.worker import HandlerTable, Server
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
    server.now = start + deadline
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
    from fedcore.course import Course
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


def test_derived_deadline_waits_for_half_the_replies_then_drops_the_rest():
    course, server = _timed_server()
    server.buffer, server.selected = [], {1, 2, 3, 4}
    server.trigger("round_check")                      # the round is first seen at 0
    server.now = 4.0
    server.buffer.extend(["u1", "u2"])                 # clients 1 and 2 replied
    server.selected -= {1, 2}
    server.trigger("round_check")                      # half replied after 4 s
    # deadline: max(10, 5 x 4) + 2 x 1000 bytes / 10000 bytes/s = 20.2 s
    server.now = 20.2
    server.trigger("round_check")
    assert course.raised == [] and server.selected == {3, 4}
    server.now = 20.3
    server.trigger("round_check")
    assert server.selected == set() and course.raised == [("all_received", 20.3)]
    assert "derived round deadline of 20.2s" in course.monitor.extra_summary["dropped"][0]["reason"]


def test_a_round_where_no_one_replies_gets_the_deadline_of_the_slowest_earlier_round():
    # one hung client sampled alone (or a hung majority) never lets a round reach half its
    # replies: the deadline then comes from the earlier rounds, or the course would stall
    course, server = _timed_server()
    server.buffer, server.selected = [], {1, 2}
    server.trigger("round_check")                      # round 4 first seen at 0
    server.now = 4.0
    server.buffer.append("u1")
    server.selected -= {1}
    server.trigger("round_check")                      # half of round 4 replied after 4 s
    server.now = 6.0
    server.buffer.append("u2")
    server.selected.clear()                            # round 4 complete
    server.round, server.buffer, server.selected = 5, [], {3}
    server.trigger("round_check")                      # round 5 first seen at 6
    _kept_until(server, 6.0, 20.2)                     # max(10, 5 x 4) + 2 x 1000 / 10000
    assert course.raised == [("all_joined_in", server.now)]
    assert "derived round deadline of 20.2s" in course.monitor.extra_summary["dropped"][0]["reason"]


def test_rounds_faster_than_the_checks_measure_later_ones_but_dropped_rounds_do_not():
    course, server = _timed_server()
    server.buffer, server.selected = [], {1}
    server.trigger("round_check")                      # round 4 first seen at 0
    server.now = 3.0                                   # it completed between two checks
    server.round, server.buffer, server.selected = 5, [], {1}
    server.trigger("round_check")                      # round 5 first seen at 3: round 4 took <= 3 s
    _kept_until(server, 3.0, 15.2)                     # max(10, 5 x 3) + 0.2
    assert course.raised == [("all_joined_in", server.now)]
    # round 5 ended by its deadline: its 15.3 s say nothing of how long a round takes
    server.buffer, server.selected = [], {2}           # round 5 sampled again
    server.trigger("round_check")
    server.now = 18.3 + 15.3
    server.trigger("round_check")
    assert server.selected == set() and server.deploy_slowest == 3.0


def test_rounds_done_before_the_first_check_saw_one_measure_the_next():
    # tiny models: the first rounds complete between two checks, and the first round a check
    # sees is the one where the only sampled client hangs
    course, server = _timed_server()
    server.started, server.round = False, 1
    server.trigger("round_check")                      # at 0: not started, round 1 to come
    server.started, server.round, server.buffer, server.selected = True, 3, [], {1}
    server.now = 0.5
    server.trigger("round_check")                      # rounds 1 and 2 took at most 0.5 s
    _kept_until(server, 0.5, 10.2)                     # max(10, 5 x 0.5) + 0.2
    assert course.raised == [("all_joined_in", server.now)]


def test_before_any_round_has_half_its_replies_there_is_no_derived_deadline_and_lists_stay_bounded():
    course, server = _server()
    server.aggregator = type("A", (), {"global_state": {}})()
    server.trigger("round_check")
    server.now = 1e6
    server.trigger("round_check")
    assert course.raised == [] and server.selected == {1, 2, 3}
    for k in range(deployment.LISTED + 30):
        server.trigger("client_lost", {"client_id": 1 + k % 3, "reason": "flapping"})
    extra = course.monitor.extra_summary
    assert len(extra["lost_clients"]) == deployment.LISTED and extra["lost_clients_total"] == deployment.LISTED + 30
