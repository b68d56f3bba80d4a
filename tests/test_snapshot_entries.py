"""Snapshot entries that `fedcore.runtime.snapshot_input` checks by their container type only:
an attacker who can write the checkpoint folder rewrites the newest snapshot with the
project's own writer (torch.save, fingerprint intact) and one such entry changed. The threat
model promises a one-line refusal naming the file and the one before it resumed (as
tests/test_snapshot_tamper.py asserts for the entries it covers); for these, the resume
raises a traceback (a TypeError, KeyError, ValueError or JSONDecodeError where the entry is
read, or a handler's error rounds later for a client state), or a `round` that disagrees
with the file resumes silently at that round."""
import logging

import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.test_snapshot_tamper import COMMON, _final, _first, _planted, _refusals, _rounds, _same, full  # noqa: F401


def _sparse_model(s):
    name = _first(s["global_state"])
    s["global_state"][name] = s["global_state"][name].to_sparse()


def _client_state_not_a_dict(s):
    s["client_states"][_first(s["client_states"])] = "junk"


OPEN = {
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
}


@pytest.mark.parametrize("what", OPEN)
def test_an_entry_of_the_right_container_but_wrong_content_is_refused_and_the_one_before_resumes(
        tmp_path, full, what, caplog):  # noqa: F811
    run = tmp_path / "run"
    _planted(full, run, OPEN[what])
    with caplog.at_level(logging.WARNING, logger="fedcore.checkpoint"):
        Course(small_cfg(run, resume_from="latest", **COMMON)).run()
    warned = _refusals(caplog)
    assert len(warned) == 1 and "\n" not in warned[0] and "round_2.pt" in warned[0], warned
    assert _rounds(run) == [1, 2, 3, 4]
    assert _same(_final(full), _final(run))
