"""FedEx between real processes: the server holds theta and steps it, each client process draws
its candidate from the theta it receives and sends its feedback with its model.

Every client's draw is seeded by (seed, client, round) and its feedback is its own validation
loss, so with full participation a deployed course equals its simulation: the same arms, the
same theta after every round, the same final model (to 1e-6). What a deployed server admits
as feedback is tested on its check (`tests/test_update_layouts.py`).
"""
import json
import math

import numpy as np
import pytest

from fedcore.algorithms.fedex import draw_arm
from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import assert_same_final_model, launch_course, write_cfg

pytestmark = pytest.mark.slow

# Candidates whose learning rates differ 30-fold move the clients' models by very different
# distances: admission's norm rule (on in deployment, off in simulation) would refuse the
# farthest, so it is off here as it is in the simulation.
COURSE = {"federate.client_num": 3, "federate.total_round_num": 3, "eval.clients": False,
          "data.splits": [0.6, 0.2, 0.2], "admission.norm_ratio": float("inf"),
          "fedex.candidates": [{"train.optimizer.lr": 0.01}, {"train.optimizer.lr": 0.3},
                               {"train.optimizer.lr": 0.1, "train.local_steps": 2}]}


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _simulated(tmp_path):
    sim_dir = tmp_path / "simulated"
    Course(small_cfg(sim_dir, **{k.replace(".", "__"): v for k, v in COURSE.items()})).run()
    return sim_dir


def test_a_deployed_fedex_course_equals_its_simulation(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "deployed"
    launch_course(procs, cfg, out, clients=3)
    sim_dir = _simulated(tmp_path)
    # round 1's draws, from the uniform theta, seeded by (seed, client, round): the clients try
    # more than one candidate, so the steps on theta compared below are not trivial
    assert len({draw_arm(np.full(3, 1 / 3), 0, c, 1) for c in (1, 2, 3)}) > 1
    assert_same_final_model(out, sim_dir, atol=1e-6)
    dep, sim = _records(out / "metrics.jsonl"), _records(sim_dir / "metrics.jsonl")
    assert [r["round"] for r in dep] == [r["round"] for r in sim] == [1, 2, 3]
    for d, s in zip(dep, sim):
        assert d["num_updates"] == s["num_updates"] == 3
        assert d["fedex_mle_arm"] == s["fedex_mle_arm"]
        assert d["fedex_entropy"] == pytest.approx(s["fedex_entropy"], rel=0, abs=1e-9)
        assert d["fedex_max_prob"] == pytest.approx(s["fedex_max_prob"], rel=0, abs=1e-9)
        assert d["bytes_up"] == s["bytes_up"] and d["bytes_down"] == s["bytes_down"]
    dep_sum = json.loads((out / "summary.json").read_text())
    sim_sum = json.loads((sim_dir / "summary.json").read_text())
    assert dep_sum["fedex_theta"] == pytest.approx(sim_sum["fedex_theta"], rel=0, abs=1e-9)
    assert dep_sum["fedex_best"] == sim_sum["fedex_best"]
    theta = np.array(dep_sum["fedex_theta"])
    assert math.isclose(theta.sum(), 1.0, abs_tol=1e-12) and abs(theta - 1 / 3).max() > 1e-3
