"""`torch_threads: auto` keeps several intra-op threads for a sequential course only while its
fits measure faster with them (fedcore.execution.thread_governor): the decision from given
timings, and a course whose clock says two threads are slower going back to one. No test
here reads the wall clock: the timings are made up."""
import pytest
import torch

import fedcore.execution.executor as executor
import fedcore.execution.thread_governor as thread_governor
from fedcore.execution.executor import usable_cores
from fedcore.execution.thread_governor import ThreadGovernor
from fedcore.runtime.course import Course
from tests.conftest import small_cfg


def _drive(governor: ThreadGovernor, rate: dict[int, float], fits: int, work: float = 10.0) -> list[int]:
    """Run `fits` fits whose seconds per unit of work are `rate[count]`; the counts chosen."""
    chosen = []
    for _ in range(fits):
        n = governor.choose()
        chosen.append(n)
        governor.record(n, rate[n] * work, work)
    return chosen


def test_the_first_fit_is_a_warm_up_then_each_count_is_measured_once():
    g = ThreadGovernor(2)
    # the warm-up fit takes 100x longer with two threads: it must not count against them
    assert g.choose() == 2
    g.record(2, 100.0, 10.0)
    assert g.rate == {}
    assert _drive(g, {2: 0.5, 1: 1.0}, 2) == [2, 1]
    assert g.rate == {2: 0.5, 1: 1.0}


def test_several_threads_are_kept_where_faster_and_one_where_not():
    fast = ThreadGovernor(2, probe_every=8)
    chosen = _drive(fast, {2: 0.6, 1: 1.0}, 1 + 2 + 20)
    assert fast.best() == 2
    # after the warm-up and one fit of each, 2 threads except one probe of 1 in each 8 fits
    assert chosen[3:] == [1 if k % 8 == 0 else 2 for k in range(3, 23)]
    slow = ThreadGovernor(2, probe_every=8)
    chosen = _drive(slow, {2: 2.4, 1: 1.0}, 1 + 2 + 20)
    assert slow.best() == 1
    assert chosen[3:] == [2 if k % 8 == 0 else 1 for k in range(3, 23)]


def test_a_gain_under_the_margin_takes_one_thread():
    # 2 threads at 0.96 of one thread's time: under the 5% margin, a core less for the same speed
    g = ThreadGovernor(2)
    _drive(g, {2: 0.96, 1: 1.0}, 3)
    assert g.best() == 1
    g = ThreadGovernor(2)
    _drive(g, {2: 0.94, 1: 1.0}, 3)
    assert g.best() == 2


def test_a_change_of_load_is_followed_at_once_or_by_the_probes():
    g = ThreadGovernor(2, probe_every=4)
    _drive(g, {2: 0.5, 1: 1.0}, 9)          # an idle machine: two threads
    assert g.best() == 2
    # a neighbour takes a core: two threads now take 3x one thread's time. The rate of 2 is
    # the mean of the last measurement and the previous rate: 0.5 -> 1.75 -> 2.375 after the
    # fits that ran with 2 threads; at 1.75 > 0.95 * 1.0 one thread is chosen already
    chosen = _drive(g, {2: 3.0, 1: 1.0}, 12)
    assert chosen[0] == 2 and g.best() == 1
    assert chosen[1:] == [2 if (10 + k) % 4 == 0 else 1 for k in range(11)]
    # the neighbour leaves: the next probes with 2 threads bring the rate back down
    _drive(g, {2: 0.5, 1: 1.0}, 12)
    assert g.best() == 2


def test_a_fit_without_work_is_not_measured():
    g = ThreadGovernor(2)
    _drive(g, {2: 1.0, 1: 1.0}, 1)
    g.record(2, 5.0, 0.0)
    assert g.rate == {}


def test_it_chooses_between_several_threads_and_one():
    with pytest.raises(ValueError, match="several threads and one, got 1"):
        ThreadGovernor(1)


@pytest.mark.skipif(usable_cores() < 2, reason="needs two usable cores")
def test_a_sequential_course_whose_two_threads_run_slower_goes_back_to_one(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(executor, "AUTO_THREADS_MFLOP", 0.0)     # every step counts as large
    clock = {"now": 0.0, "counts": []}

    def perf_counter():
        # each reading advances a made-up clock: 3 s with two threads, 1 s with one
        clock["counts"].append(torch.get_num_threads())
        clock["now"] += 3.0 if torch.get_num_threads() == 2 else 1.0
        return clock["now"]
    monkeypatch.setattr(thread_governor, "perf_counter", perf_counter)
    course = Course(small_cfg(None, federate__total_round_num=4, federate__sample_client_num=3)).build()
    governor = course.trainer.thread_governor
    assert governor.most == 2
    summary = course.run()
    fits = governor.fits
    assert fits == 4 * 3 == sum(governor.fits_by_count.values())
    assert governor.best() == 1
    # warm-up and first measure with 2, one with 1, then 1 except a probe of 2 every 8th fit
    expected = [2, 2, 1] + [2 if k % 8 == 0 else 1 for k in range(3, fits)]
    assert governor.fits_by_count == {2: expected.count(2), 1: expected.count(1)}
    assert summary["fits_by_torch_threads"] == {"2": expected.count(2),
                                                                           "1": expected.count(1)}


@pytest.mark.skipif(usable_cores() < 2, reason="needs two usable cores")
def test_no_governor_where_the_count_is_given_or_the_course_is_vectorized(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(executor, "AUTO_THREADS_MFLOP", 0.0)
    assert not hasattr(Course(small_cfg(None, torch_threads=2)).build().trainer, "thread_governor")
    course = Course(small_cfg(None, executor="vectorized")).build()
    assert torch.get_num_threads() == 2 and not hasattr(course.trainer, "thread_governor")
