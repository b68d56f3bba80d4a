"""Snapshot entries of the right container but wrong contents: an attacker who can write the
checkpoint folder rewrites the newest snapshot with the project's own writer (torch.save,
fingerprint intact) and one such entry changed. Each is refused in one line naming the file
before any state is restored, and the snapshot before it resumes the course to the
uninterrupted course's model (where unchecked, the resume raised a TypeError, KeyError,
ValueError or JSONDecodeError where the entry is read, a handler's error rounds later for a
client state, or went on silently from the round the entry named)."""
import logging

import pytest
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.test_snapshot_tamper import COMMON, _final, _first, _planted, _refusals, _rounds, _same, full  # noqa: F401


def _sparse_model(s):
    name = _first(s["global_state"])
    s["global_state"][name] = s["global_state"][name].to_sparse()


def _client_state_not_a_dict(s):
    s["client_states"][_first(s["client_states"])] = "junk"


CASES = {
    "sparse model tensor": _sparse_model,
    "records of non-records": lambda s: s.update(records=[1, "x", None]),
    "records text not json": lambda s: s.update(records="garbage\n{"),
    "pending of non-records": lambda s: s.update(pending={"a": 1}),
    "bytes of one value": lambda s: s.update(bytes=["x"]),
    "best of three values": lambda s: s.update(best=["x", "y", "z"]),
    "target of one value": lambda s: s.update(target=[None]),
    "aggregator entry removed": lambda s: s["aggregator"].pop(_first(s["aggregator"])),
    "aggregator entry a string": lambda s: s["aggregator"].update({_first(s["aggregator"]): "x"}),
    "client state not a dict": _client_state_not_a_dict,
    "round negative": lambda s: s.update(round=-3),
    "round 0 in round_2.pt": lambda s: s.update(round=0),
    "round 10**9 in round_2.pt": lambda s: s.update(round=10**9),
    "virtual_time NaN": lambda s: s.update(virtual_time=float("nan")),
    "virtual_time -inf": lambda s: s.update(virtual_time=float("-inf")),
    "bytes negative": lambda s: s.update(bytes=[-1, 0, 0]),
    "best count a string": lambda s: s.update(best=[None, "0"]),
    "pending expected a string": lambda s: s.update(pending={"2": {"record": {}, "expected": "x"}}),
}


@pytest.mark.parametrize("what", CASES)
def test_an_entry_of_the_right_container_but_wrong_content_is_refused_and_the_one_before_resumes(
        tmp_path, full, what, caplog):  # noqa: F811
    run = tmp_path / "run"
    _planted(full, run, CASES[what])
    with caplog.at_level(logging.WARNING, logger="fedcore.checkpoint"):
        Course(small_cfg(run, resume_from="latest", **COMMON)).run()
    warned = _refusals(caplog)
    assert len(warned) == 1 and "\n" not in warned[0] and "round_2.pt" in warned[0], warned
    assert _rounds(run) == [1, 2, 3, 4]
    assert _same(_final(full), _final(run))


def test_a_damaged_snapshot_named_alone_is_refused_naming_the_file_and_the_fault(tmp_path, full):  # noqa: F811
    folder = tmp_path / "alone"
    folder.mkdir()
    state = torch.load(full / "checkpoints" / "round_2.pt", weights_only=True)
    state["round"] = 1
    torch.save(state, folder / "round_3.pt")   # a round that disagrees with its file, none beside it
    with pytest.raises(ConfigError) as err:
        Course(small_cfg(tmp_path / "r", resume_from=str(folder / "round_3.pt"), **COMMON)).build()
    assert str(err.value) == (f"resume_from: '{folder / 'round_3.pt'}' is damaged "
                              "(entry 'round' is 1, its file's is 3)")


def test_a_snapshot_naming_another_algorithm_is_a_course_refusal_with_no_fallback(tmp_path, full):  # noqa: F811
    # an older snapshot of the same run names the same algorithm: none would do better
    run = tmp_path / "run"
    _planted(full, run, lambda s: s.update(algorithm="fedavg"))
    with pytest.raises(ConfigError, match=r"round_2.pt' was written by algorithm.name fedavg, not scaffold"):
        Course(small_cfg(run, resume_from="latest", **COMMON)).build()
