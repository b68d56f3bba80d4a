"""The event queue: time order, priorities, deterministic ties, stop, handler errors."""
import pytest

from fedcore.kernel.scheduler import PRIORITY_MESSAGE, PRIORITY_TIMER, Scheduler


def test_events_run_in_time_order_and_clock_jumps():
    s = Scheduler()
    seen = []
    for t in (5.0, 1.0, 3.0):
        s.schedule(t, PRIORITY_MESSAGE, lambda t=t: seen.append((t, s.now)))
    s.run()
    assert seen == [(1.0, 1.0), (3.0, 3.0), (5.0, 5.0)]
    assert s.processed == 3


def test_ties_broken_by_priority_then_insertion_order():
    s = Scheduler()
    seen = []
    s.schedule(2.0, PRIORITY_MESSAGE, lambda: seen.append("msg-a"))
    s.schedule(2.0, PRIORITY_MESSAGE, lambda: seen.append("msg-b"))
    s.schedule(2.0, PRIORITY_TIMER, lambda: seen.append("timer"))
    s.schedule(1.0, PRIORITY_MESSAGE, lambda: seen.append("early"))
    s.run()
    assert seen == ["early", "timer", "msg-a", "msg-b"]


def test_event_scheduled_in_the_past_runs_now_not_before():
    s = Scheduler()
    seen = []

    def at_four():
        s.schedule(1.0, PRIORITY_MESSAGE, lambda: seen.append(s.now))
    s.schedule(4.0, PRIORITY_MESSAGE, at_four)
    s.run()
    assert seen == [4.0]


def test_stop_drops_the_rest_and_until_pauses():
    s = Scheduler()
    seen = []
    s.schedule(1.0, PRIORITY_MESSAGE, lambda: seen.append(1))
    s.schedule(2.0, PRIORITY_MESSAGE, lambda: seen.append(2))
    s.schedule(3.0, PRIORITY_MESSAGE, lambda: (seen.append(3), s.stop()))
    s.schedule(4.0, PRIORITY_MESSAGE, lambda: seen.append(4))
    s.run(until=1.5)
    assert seen == [1] and s.now == 1.5
    s.run()
    assert seen == [1, 2, 3] and s.pending() == 1


def test_handler_exception_names_event_worker_and_round(tmp_path):
    from fedcore.runtime.course import Course
    from fedcore.kernel.scheduler import HandlerError
    from tests.conftest import small_cfg

    course = Course(small_cfg(tmp_path)).build()

    def broken(client, msg):
        raise ValueError("boom")
    course.client_table.register("receiving_models", broken, sends=("updates",))
    with pytest.raises(HandlerError) as info:
        course.run()
    text = str(info.value)
    assert "receiving_models" in text and "client 1" in text and "round 1" in text and "boom" in text
