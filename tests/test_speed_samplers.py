"""Speed-aware samplers: responsiveness favours fast devices; group takes speed groups in turn."""
from collections import Counter

from fedcore.runtime.course import Course
from fedcore.runtime.speed_sampling import GroupSampler, ResponsivenessSampler
from fedcore.runtime.timing import DeviceProfile, TimeModel
from tests.conftest import small_cfg

IDS = [1, 2, 3, 4, 5, 6]
# compute speed c -> a round of 60 evaluations takes 60/c s (network negligible)
TIMING = TimeModel({c: DeviceProfile(compute_speed=10.0 * c, latency=0.0, upload_bandwidth=1e15,
                                     download_bandwidth=1e15) for c in IDS})


def calibrated(cls, **attrs):
    s = cls(IDS, seed=0, timing=TIMING)
    for k, v in attrs.items():
        setattr(s, k, v)
    s.calibrate({c: 60.0 for c in IDS}, 0)
    return s


def test_round_times_come_from_the_time_model():
    s = calibrated(ResponsivenessSampler)
    assert s.round_time[1] == 6.0 and s.round_time[6] == 1.0


def test_responsiveness_prefers_fast_devices():
    s = calibrated(ResponsivenessSampler)
    picks = Counter(c for _ in range(3000) for c in s.sample(1, IDS))
    # P(i) proportional to 1/T_i = c/6: client 6 six times as often as client 1
    assert picks[6] / picks[1] > 4 and picks[6] > picks[3] > picks[1]
    assert calibrated(ResponsivenessSampler, power=0.0).sample(6, IDS) == IDS
    # a steep power picks the fastest idle devices
    steep = calibrated(ResponsivenessSampler, power=60.0)
    assert steep.sample(2, IDS) == [5, 6] and steep.sample(2, [1, 2, 3]) == [2, 3]


def test_group_sampler_takes_speed_groups_in_turn_and_spills_over():
    s = calibrated(GroupSampler, num_groups=3)
    assert s.groups == [{5, 6}, {3, 4}, {1, 2}]      # fastest first
    assert [s.sample(2, IDS) for _ in range(4)] == [[5, 6], [3, 4], [1, 2], [5, 6]]
    # current group {3, 4} has one idle client: the rest comes from the next group
    assert s.sample(2, [1, 2, 4]) in ([1, 4], [2, 4])


def test_configure_reads_keys_and_the_course():
    course = Course(small_cfg(None, federate__sampler="group", federate__sampler_groups=2,
                              time__profiles={"type": "random", "compute_speed": {
                                  "dist": "uniform", "low": 10, "high": 100}})).build()
    s = course.server.sampler
    assert s.num_groups == 2 and len(s.groups) == 2
    slow = max(s.round_time, key=s.round_time.get)
    assert course.timing.profile(slow).compute_speed == min(
        p.compute_speed for p in course.timing.profiles.values())
