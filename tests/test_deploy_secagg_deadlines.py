"""A deployed secure course is timed per stage: a client that withholds one stage's answer while
its heartbeats flow (the project's own client with that stage changed, tests/secagg_adversary_plugin.py)
is dropped at that stage's derived deadline, not at the 600 s ceiling; the round completes with the
others through dropout recovery, and the client, answering again in the next round, is summed."""
import json
import re

import pytest

from tests.conftest import need_extra

need_extra("secagg")

from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import assert_same_final_model, launch_course, write_cfg

pytestmark = pytest.mark.slow

SILENCE = 10.0     # distribute.heartbeat_timeout (the default): the floor of every derived deadline,
                   # and long enough that no live process on a loaded machine is taken for dead
CEILING = 600.0    # distribute.max_round_deadline (the default): what a stage waited for before
COURSE = {"secure_aggregation.enabled": True, "eval.clients": False, "model.dtype": "float64",
          "plugins": ["tests.secagg_adversary_plugin"], "federate.client_num": 4,
          "federate.total_round_num": 2, "secagg_test.bad_client": 4, "secagg_test.bad_rounds": [1],
          "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": SILENCE,
          "distribute.max_round_deadline": CEILING}


@pytest.mark.parametrize("adversary, request_type, summed", [
    # its masked input is in; the others' shares of its seed (t = 2 of 3) remove its self mask
    ("withhold", "secagg_unmask_request", [4, 4]),
    # a dropout after sharing: its pairwise masks are removed with its mask key's shares
    ("withhold_input", "secagg_routed_shares", [3, 4]),
], ids=["unmask", "masked_input"])
def test_a_client_withholding_a_stage_is_dropped_at_its_deadline_and_summed_when_it_answers(
        tmp_path, procs, adversary, request_type, summed):
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, "secagg_test.adversary": adversary})
    out = tmp_path / "deployed"
    # Held at the ceiling, round 1 alone would take over 600 s: the launch's timeout is below it.
    launch_course(procs, cfg, out, clients=4, timeout=CEILING / 2)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["num_updates"] for r in records] == summed   # round 2: client 4 answers and is summed
    summary = json.loads((out / "summary.json").read_text())
    (drop,) = summary["dropped"]                            # once, in round 1, and never benched
    assert drop["round"] == 1 and drop["clients"] == [4] and "lost_clients" not in summary
    m = re.fullmatch(rf"no reply to {request_type} within the derived deadline of ([0-9.]+)s "
                     r"\(distribute.deadline_factor\)", drop["reason"])
    assert m, drop["reason"]
    # measured on the others' replies to this stage (milliseconds), so at its floor, not the ceiling
    assert SILENCE <= float(m.group(1)) < CEILING / 10

    # The same course simulated: the same sums (the withheld unmask answer takes nothing away, so
    # that course equals the honest one; a withheld masked input leaves client 4 out of round 1).
    sim = tmp_path / "simulated"
    overrides = {k.replace(".", "__"): v for k, v in COURSE.items() if not k.startswith("distribute.")}
    if adversary == "withhold":
        overrides["secagg_test__bad_client"] = 0              # no adversary at all
    Course(small_cfg(sim, secagg_test__adversary=adversary, secure_aggregation__stage_timeout=5.0,
                     **overrides)).run()
    assert [json.loads(line)["num_updates"] for line in (sim / "metrics.jsonl").read_text().splitlines()] == \
        ([4, 4] if adversary == "withhold" else summed)
    assert_same_final_model(out, sim)
