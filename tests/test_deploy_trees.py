"""A deployed trees course (server and clients as processes on loopback) grows the same trees
as its simulation: the same handlers, the same histograms, summed in the same order; with
secure aggregation too, where the server unmasks only the sum of the clients' codes."""
import json

import pytest
from tests.conftest import skip_module_without

import fedcore
from tests.deploy_helpers import ROOT, launch_course

pytestmark = pytest.mark.slow
skip_module_without("trees", "xgboost")
skip_module_without("data", "sklearn")


def _cfg(tmp_path, clients: int, extra: str = ""):
    cfg = tmp_path / "trees.yaml"
    cfg.write_text(f"defaults: [{ROOT / 'scenarios' / 'xgboost_horizontal.yaml'}]\n"   # the scenario, smaller
                   f"trees: {{num_trees: 2, max_depth: 2}}\nfederate: {{client_num: {clients}}}\nverbose: 0\n"
                   + extra)
    return cfg


def _deployed_and_simulated(tmp_path, procs, cfg, clients: int):
    sim = fedcore.run(cfg, outdir=str(tmp_path / "sim"))
    launch_course(procs, cfg, tmp_path / "dep", clients=clients)
    deployed = json.loads((tmp_path / "dep" / "final_model.json").read_text())
    simulated = json.loads((sim.outdir / "final_model.json").read_text())
    assert deployed == simulated and len(deployed["learner"]["gradient_booster"]["model"]["trees"]) == 2
    records = [json.loads(line) for line in (tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5] and all(r["num_updates"] == clients for r in records)
    assert records[-1]["test_acc"] == sim.records[-1]["test_acc"]
    return records


def test_deployed_trees_equal_simulation(tmp_path, procs):
    records = _deployed_and_simulated(tmp_path, procs, _cfg(tmp_path, 3), 3)
    for r in records:   # per client: the bytes the server's communicator counted, and its reply's time
        assert sum(r[f"bytes_client_{c}"] for c in (1, 2, 3)) == r["bytes_up"] + r["bytes_down"]
        assert all(r[f"virtual_time_client_{c}"] <= r["virtual_time"] for c in (1, 2, 3))


def test_deployed_secure_trees_equal_simulation(tmp_path, procs):
    pytest.importorskip("cryptography", reason="secure aggregation needs cryptography (extra: secagg)")
    records = _deployed_and_simulated(
        tmp_path, procs, _cfg(tmp_path, 4, "secure_aggregation: {enabled: true}\n"), 4)
    assert all(r["secagg_survivors"] == 4 for r in records[1:])
