"""A deployed trees course (server and clients as processes on loopback) grows the same trees
as its simulation: the same handlers, the same histograms, summed in the same order."""
import json

import pytest

import fedcore
from tests.deploy_helpers import ROOT, launch_course

pytestmark = pytest.mark.slow
pytest.importorskip("xgboost", reason="task: trees needs xgboost (extra: trees)")
pytest.importorskip("sklearn", reason="the breast_cancer table needs scikit-learn (extra: data)")


def test_deployed_trees_equal_simulation(tmp_path, procs):
    cfg = tmp_path / "trees.yaml"
    cfg.write_text(f"defaults: [{ROOT / 'scenarios' / 'xgboost_horizontal.yaml'}]\n"   # the scenario, smaller
                   "trees: {num_trees: 2, max_depth: 2}\nfederate: {client_num: 3}\nverbose: 0\n")
    sim = fedcore.run(cfg, outdir=str(tmp_path / "sim"))
    launch_course(procs, cfg, tmp_path / "dep", clients=3)
    deployed = json.loads((tmp_path / "dep" / "final_model.json").read_text())
    simulated = json.loads((sim.outdir / "final_model.json").read_text())
    assert deployed == simulated and len(deployed["learner"]["gradient_booster"]["model"]["trees"]) == 2
    records = [json.loads(line) for line in (tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5] and all(r["num_updates"] == 3 for r in records)
    assert records[-1]["test_acc"] == sim.records[-1]["test_acc"]
