"""A deployed central-DP server folds each arriving update's clipped delta through the same
FoldingBuffer as a simulation (algorithms/dp_fold.py): with seeded noise and coins (the
diagnostic switch) its course ends with the simulation's model."""
import json

import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import assert_same_final_model, launch_course, write_cfg

pytestmark = pytest.mark.slow

KEYS = {"privacy.dp.mode": "central", "federate.sample_client_num": 2, "federate.total_round_num": 3,
        "eval.clients": False, "privacy.dp.noise_multiplier": 0.5, "privacy.dp.clip_norm": 0.3,
        "aggregator.streaming": "on", "seed": 1}
SEEDED = {"privacy.dp.noise_source": "seeded", "privacy.dp.seeded_noise_in_deployment": True}


def _records(outdir):
    return [json.loads(x) for x in (outdir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_a_deployed_folding_dp_course_ends_with_the_simulations_model(tmp_path, procs):
    sims = {}
    for mode in ("on", "off"):   # folded and listed in simulation: the same course bit for bit
        sims[mode] = tmp_path / f"sim_{mode}"
        Course(small_cfg(sims[mode], federate__client_num=3, **{
            k.replace(".", "__"): v for k, v in {**KEYS, "aggregator.streaming": mode}.items()})).run()
    assert_same_final_model(sims["on"], sims["off"], atol=0)
    out = tmp_path / "deployed"
    launch_course(procs, write_cfg(tmp_path / "course.yaml", {**KEYS, **SEEDED}), out, clients=3)
    sizes = [r["num_updates"] for r in _records(out)]
    assert sizes == [r["num_updates"] for r in _records(sims["on"])] and sum(sizes) > 0
    assert [r["dp_clipped"] for r in _records(out)] == [r["dp_clipped"] for r in _records(sims["on"])]
    # the deployed server folds in arrival order, the simulation in client-id order: the float64
    # sums differ by a rounding before their cast, the model by about a float32 ulp a round
    assert_same_final_model(out, sims["on"], atol=1e-6)
    final = torch.load(out / "final_model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in final.values())
