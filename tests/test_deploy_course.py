"""Real processes on loopback: a deployed course equals its simulation, over mutual TLS.

The launcher starts a server and three clients; with fixed seeds, full
participation and synchronous FedAvg the final model must equal the
single-process simulation's (aggregation sorts updates by client id, so the
order in which updates arrive cannot matter), and every round must count
the same bytes as the simulation's exact envelope sizes.
"""
import json

import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import FORK, make_certs, text, wait_exit, write_cfg

pytestmark = pytest.mark.slow


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_deployed_course_over_mutual_tls_equals_the_simulation(tmp_path, procs):
    certs = make_certs(tmp_path / "certs")
    cfg = write_cfg(tmp_path / "course.yaml", {"distribute.token": "s3cret", "distribute.tls.ca": certs["ca"],
                                               "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "deployed"
    launcher = procs.start("launch", [
        "-m", "fedcore.launch", *FORK, "--cfg", str(cfg), "--clients", "3", f"outdir={out}",
        "--server-opt", f"distribute.tls.cert={certs['server_cert']}",
        "--server-opt", f"distribute.tls.key={certs['server_key']}",
        "--client-opt", f"distribute.tls.cert={certs['client_cert']}",
        "--client-opt", f"distribute.tls.key={certs['client_key']}"])
    assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    log = text(launcher)
    assert "insecure" not in log  # TLS was on: no plaintext warning
    for k in (1, 2, 3):
        assert f"client {k}: course finished" in log

    sim_dir = tmp_path / "simulated"
    Course(small_cfg(sim_dir, federate__client_num=3)).run()
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    assert deployed.keys() == simulated.keys()
    for name in simulated:
        assert torch.allclose(deployed[name], simulated[name], rtol=0, atol=1e-6), name

    dep, sim = _records(out / "metrics.jsonl"), _records(sim_dir / "metrics.jsonl")
    assert [r["round"] for r in dep] == [r["round"] for r in sim] == [1, 2]
    for d, s in zip(dep, sim):
        assert d["num_updates"] == s["num_updates"] == 3
        assert d["bytes_up"] == s["bytes_up"] and d["bytes_down"] == s["bytes_down"]
        assert d["test_acc"] == pytest.approx(s["test_acc"], abs=1e-6)
        assert d["client_evals"] == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and "lost_clients" not in summary
