"""A deployed analytics course (server and clients as processes on loopback) writes the same
statistics as its simulation: the same handlers, the same exact sums."""
import json

import pytest

import fedcore
from tests.conftest import skip_module_without
from tests.deploy_helpers import ROOT, launch_course

pytestmark = pytest.mark.slow
skip_module_without("data", "sklearn")   # the wine table, read by the processes this test starts


def test_deployed_statistics_equal_simulation(tmp_path, procs):
    cfg = tmp_path / "analytics.yaml"
    cfg.write_text(f"defaults: [{ROOT / 'scenarios' / 'analytics.yaml'}]\n"   # the scenario, smaller
                   "analytics: {columns: [alcohol, proline], quantile_rounds: 2}\n"
                   "federate: {client_num: 3}\nverbose: 0\n")
    sim = fedcore.run(cfg, outdir=str(tmp_path / "sim"))
    launch_course(procs, cfg, tmp_path / "dep", clients=3)
    deployed = json.loads((tmp_path / "dep" / "statistics.json").read_text())
    simulated = json.loads((sim.outdir / "statistics.json").read_text())
    assert deployed == simulated
    assert deployed["statistics"]["alcohol"]["class_0"]["count"] == 59
    records = [json.loads(line) for line in (tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2] and all(r["num_updates"] == 3 for r in records)
