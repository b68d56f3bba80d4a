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
    chosen = _drive(fast, {2: 0.6, 1: 1.0}, 1 + 2 + 140)
    assert fast.best() == 2
    # one thread costs 1/0.6 - 1 = 2/3 of a fit more: spread over 1% of the fits' time, a probe
    # every ceil(66.7) = 67 fits after the fit that measured it (the third, index 2)
    assert chosen[3:] == [1 if k in (2 + 67, 2 + 2 * 67) else 2 for k in range(3, 143)]
    slow = ThreadGovernor(2, probe_every=8)
    chosen = _drive(slow, {2: 2.455, 1: 1.0}, 1 + 2 + 300)
    assert slow.best() == 1
    # two threads cost 1.455 fits more: a probe every ceil(145.5) = 146 fits
    assert chosen[3:] == [2 if k in (2 + 146, 2 + 2 * 146) else 1 for k in range(3, 303)]


def test_probes_cost_at_most_one_percent_and_are_spaced_between_the_bounds():
    # the time the probes cost beyond that of running every fit at the best count, from the
    # rates: at most 1% of it wherever the other count is at most 3.56x slower (2.56 fits
    # more, spaced 256 fits apart at most)
    for rate in ({2: 0.6, 1: 1.0}, {2: 2.455, 1: 1.0}, {2: 3.5, 1: 1.0}, {2: 0.97, 1: 1.0}):
        g = ThreadGovernor(2)
        chosen = _drive(g, rate, 3 + 2000)[3:]
        best = g.best()
        extra = sum(rate[n] - rate[best] for n in chosen)
        assert extra <= 0.01 * rate[best] * len(chosen) + 1e-9, rate
        probes = [k for k, n in enumerate(chosen) if n != best]
        gaps = [b - a for a, b in zip(probes[:-1], probes[1:])]
        assert gaps and all(ThreadGovernor.PROBE_EVERY <= gap <= ThreadGovernor.PROBE_MOST for gap in gaps), rate
    # 9x slower: its excess (8 fits) would space probes 800 fits apart; at most 256
    g = ThreadGovernor(2)
    chosen = _drive(g, {2: 9.0, 1: 1.0}, 3 + 600)
    assert [k for k, n in enumerate(chosen) if n == 2 and k > 2] == [2 + 256, 2 + 512]


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
    # the mean of the last measurement and the previous rate: 0.5 -> 1.75 after the first fit
    # with 2 threads, above 0.95 * 1.0: one thread from the next fit on (fit index 10), and
    # two threads' excess of 0.75 puts the next probe 75 fits after index 2's
    chosen = _drive(g, {2: 3.0, 1: 1.0}, 12)
    assert chosen == [2] + [1] * 11 and g.best() == 1
    # the neighbour leaves: the probe at index 77 measures 0.5 (rate (1.75 + 0.5) / 2 = 1.125,
    # still one thread, an excess of 0.125: 13 fits on), the one at index 90 brings it to
    # 0.8125 < 0.95: two threads from index 91
    chosen = _drive(g, {2: 0.5, 1: 1.0}, 80)           # fit indexes 21 .. 100
    assert [21 + k for k, n in enumerate(chosen) if n == 2][:2] == [77, 90]
    assert chosen[91 - 21:] == [2] * (101 - 91) and g.best() == 2


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
    # warm-up and first measure with 2, one with 1, then 1: two threads' excess of 2 fits puts
    # the first probe 200 fits on, past the course's 12
    expected = [2, 2, 1] + [1] * (fits - 3)
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
