"""A hostile edge process against a deployed hierarchical course, real processes on loopback.

The hostile edge (tests/hostile_edge.py) is the project's edge process with two stages
changed: it joins the cloud at once, with no client, declaring 10^9 samples, and answers each
cloud model with the class biases moved +5/-5 claiming 10^9 samples. It holds the course's
token, as every edge does. The cloud must refuse the declaration at the join (one line naming
the edge, counted in the summary), aggregate none of its models, and end on the honest
edges' course: flat FedAvg over their clients (kappa_2 = 1, full participation: equal up to
float rounding), with its accuracy.
"""
import json

import pytest
import torch

from fedcore.kernel import registry
from fedcore.runtime.course import Course
from fedcore.scenarios.data import FederatedData
from tests.conftest import small_cfg
from tests.deploy_helpers import server_port, text, wait_exit, write_cfg
from tests.hostile_edge import DECLARED
from tests.test_deploy_hierarchy import WIRE, _edge_port, _records

pytestmark = pytest.mark.slow

# 4 clients under 3 edges: 5: [1, 2], 6: [3], 7: [4]; edge 7 is hostile and client 4 never starts
COURSE = {"federate.client_num": 4, "topology.edges": 3, "train.local_steps": 2, "eval.clients": False}


def test_a_hostile_edge_process_does_not_take_the_course_over(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, **WIRE})
    out = tmp_path / "deployed"
    cloud = procs.fedcore("cloud", cfg, "distribute.role=server", "distribute.server_port=0", f"outdir={out}")
    port = server_port(out, cloud)
    edge_args = ["distribute.role=edge", f"distribute.cloud_port={port}", "distribute.server_port=0",
                 f"outdir={out}"]
    hostile = procs.start("hostile", ["-m", "tests.hostile_edge", "--cfg", str(cfg), "distribute.edge_id=7",
                                      "federate.mode=distributed", *edge_args])
    edges = {e: procs.fedcore(f"edge{e}", cfg, f"distribute.edge_id={e}", *edge_args) for e in (5, 6)}
    ports = {e: _edge_port(out, e, p) for e, p in edges.items()}
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.client_id={k}",
                             f"distribute.server_port={ports[5 if k <= 2 else 6]}") for k in (1, 2, 3)]
    assert wait_exit(cloud, 120) == 0, text(cloud)[-3000:] + text(hostile)[-3000:]
    for p in [*edges.values(), *clients]:
        assert wait_exit(p, 60) == 0, text(p)[-3000:]
    log = text(cloud)
    assert f"refused edge 7's declaration of {DECLARED} samples" in log, log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rounds = COURSE.get("federate.total_round_num", 2)
    assert summary["admission"] == {"edge declaration above its clients' bound": 1,
                                    "num_samples above the declared count": rounds}
    records = _records(out / "metrics.jsonl")
    assert [r["num_updates"] for r in records] == [2] * rounds

    # the honest course: flat FedAvg over clients 1-3, on the same partitions and test set
    keys = {k.replace(".", "__"): v for k, v in COURSE.items() if k != "topology.edges"}
    data = registry.components.get("federated_data")(small_cfg(None, **keys))
    honest_data = FederatedData({c: d for c, d in data.clients.items() if c != 4}, data.server_test,
                                data.input_shape, data.num_classes)
    honest = tmp_path / "honest"
    Course(small_cfg(honest, **{**keys, "federate__client_num": 3})).build(data=honest_data).run()
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    expected = torch.load(honest / "final_model.pt", weights_only=True)
    for entry in expected:   # float rounding, far below the poison's 5 per round
        assert torch.allclose(deployed[entry], expected[entry], rtol=0, atol=1e-5), entry
    assert [r["test_acc"] for r in records] == [r["test_acc"] for r in _records(honest / "metrics.jsonl")]
