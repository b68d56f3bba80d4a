"""Every kind of course that runs in simulation runs, unchanged, between real processes.

Synchronous courses with fixed seeds and full participation must end with the
simulation's final model (to 1e-6) and count the same bytes per round:
SCAFFOLD (its updates carry control-variate deltas, its broadcast the server's
control variate), FedDyn, FedRep and pFedMe (heads and personal models stay
with each client), an MLP with dropout (each client's masks from its own stream), DiLoCo (inner optimizer state stays with each client
and is never sent), FedAdam on FedNova (the normalizing factor crosses the
wire, the server optimizer's moments stay with the server) and FedAvg with
local DP noise combined by the coordinate median (two behaviour plug-ins, each
process installing its own half), and a drifting client against centered
clipping (the attack in one client's process, the rule's history in the server's).
Asynchronous courses (goal_achieved with after_receiving, time_up with a wall
budget) must finish over gRPC even when a client is SIGKILLed mid-course.
"""
import json

import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import FORK, server_port, text, wait_exit, wait_for, write_cfg

pytestmark = pytest.mark.slow


def _records(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


SYNC_COURSES = {
    "scaffold": {"algorithm.name": "scaffold"},
    "feddyn": {"algorithm.name": "feddyn"},
    "diloco": {"algorithm.name": "diloco", "train.local_steps": 3,
               "train.preserve_optimizer_state": True, "train.optimizer.type": "adamw"},
    # FedAdam on FedNova's aggregate: unequal local work (time-budgeted on unequal devices,
    # quantity partition), the normalizing factor crossing the wire, the optimizer's moments
    # staying with the server
    "fednova_fedadam": {"algorithm.name": "fednova", "data.partition": "quantity",
                        "data.synthetic.samples_per_client": None, "train.local_time_budget": 0.3,
                        "time.profiles": {"type": "lognormal", "median": 100, "sigma": 0.7},
                        "server_optimizer.type": "adam", "server_optimizer.lr": 0.05},
    # seeded noise, asked for explicitly: a deployment draws OS noise unless told otherwise
    "local_dp_median": {"privacy.dp.mode": "local", "privacy.dp.noise_multiplier": 0.1,
                        "aggregator.robust_rule": "median", "privacy.dp.noise_source": "seeded",
                        "privacy.dp.seeded_noise_in_deployment": True},
    # personalization: FedRep's heads and pFedMe's personal models stay in each client's state,
    # only the representation / the local model crosses the wire
    "fedrep": {"algorithm.name": "fedrep", "model.type": "mlp", "model.hidden": [6],
               "algorithm.fedrep.head_epochs": 2},
    "pfedme": {"algorithm.name": "pfedme", "algorithm.pfedme.beta": 1.5},
    # dropout: each client draws its masks from its own (seed, client, round) stream, in its
    # process as in the simulation
    "mlp_dropout": {"model.type": "mlp", "model.hidden": [6], "model.mlp_dropout": 0.3,
                    "train.local_steps": 3},
    # client 1 drifts (only its own process knows), the server clips around its history
    "drift_centered_clip": {"attack.type": "drift", "attack.clients": [1], "admission.norm_ratio": 50.0,
                            "aggregator.robust_rule": "centered_clip", "aggregator.cc_tau": 0.1},
}


@pytest.mark.parametrize("name", sorted(SYNC_COURSES))
def test_deployed_sync_course_equals_the_simulation(tmp_path, procs, name):
    keys = {"federate.client_num": 2, "eval.clients": False, **SYNC_COURSES[name]}
    cfg = write_cfg(tmp_path / "course.yaml", {**keys, "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    log = text(launcher)
    assert "refused" not in log and "client 2: course finished" in log

    sim_dir = tmp_path / "simulated"
    Course(small_cfg(sim_dir, **{k.replace(".", "__"): v for k, v in keys.items()})).run()
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    assert deployed.keys() == simulated.keys()
    for entry in simulated:
        assert torch.allclose(deployed[entry], simulated[entry], rtol=0, atol=1e-6), entry
    dep, sim = _records(out / "metrics.jsonl"), _records(sim_dir / "metrics.jsonl")
    assert [r["round"] for r in dep] == [r["round"] for r in sim] == [1, 2]
    for d, s in zip(dep, sim):
        assert d["num_updates"] == s["num_updates"] == 2
        assert d["bytes_up"] == s["bytes_up"] and d["bytes_down"] == s["bytes_down"]


# Each round lasts at least 0.5 s of wall time (a client's pause, or the budget), so 20 rounds
# outlast the 3 s in which the server notices the killed client.
ROUNDS = 20
ASYNC_COURSES = {
    "goal_achieved": {"asyn.aggregator": "goal_achieved", "asyn.min_received_num": 2,
                      "asyn.broadcast_manner": "after_receiving", "slow_test.pause": 0.5},
    "time_up": {"asyn.aggregator": "time_up", "asyn.time_budget": 0.5, "slow_test.pause": 0.2},
}


@pytest.mark.parametrize("name", sorted(ASYNC_COURSES))
def test_async_course_finishes_over_grpc_with_a_client_killed(tmp_path, procs, name):
    cfg = write_cfg(tmp_path / "course.yaml", {
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedasync_pausing",
        "asyn.use": True, **ASYNC_COURSES[name], "federate.total_round_num": ROUNDS,
        "eval.clients": False, "distribute.insecure": True, "distribute.token": "t",
        "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 3.0,
        "distribute.retry_timeout": 2.0})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    clients = {k: procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                                f"distribute.client_id={k}") for k in (1, 2, 3)}
    wait_for(lambda: _records(out / "metrics.jsonl"), 180, "the first aggregation")
    clients[2].kill()  # SIGKILL: no goodbye; the server must notice the silence and go on

    assert wait_exit(server, 180) == 0, text(server)[-3000:]
    log = text(server)
    assert "client 2 lost" in log and "no heartbeat" in log
    records = _records(out / "metrics.jsonl")
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    summary = json.loads((out / "summary.json").read_text())
    manner = ASYNC_COURSES[name].get("asyn.broadcast_manner", "after_aggregating")
    assert summary["strategy"] == f"async {name} {manner}"
    assert any(e["client"] == 2 for e in summary["lost_clients"])
    assert summary["deployment"]["clients"]["2"]["state"] == "lost"
    for k in (1, 3):
        assert wait_exit(clients[k], 60) == 0, text(clients[k])[-2000:]
