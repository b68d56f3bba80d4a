"""A hierarchical course (HierFAVG) between real processes: a cloud server, edge processes that
serve their clients and dial the cloud, and clients that dial their edge.

Synchronous HierFAVG with full participation is deterministic, so the deployed course must
end with the simulation's final model (to 1e-6) and move as many bytes over the edge-cloud
tier each round; a SIGKILLed edge is dropped by the cloud like a dead client (the course
goes on with the other edge) and, started again on its port, is rejoined by its clients and
rejoins the cloud.
"""
import json

import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.deployment.edge_process import address_file
from tests.conftest import small_cfg
from tests.deploy_helpers import FORK, server_port, text, wait_exit, wait_for, write_cfg

pytestmark = pytest.mark.slow

# 4 clients under 2 edges (ids 5 and 6: clients 1-2 and 3-4), kappa_2 = 2 edge rounds
COURSE = {"federate.client_num": 4, "topology.edges": 2, "topology.edge_rounds": 2,
          "train.local_steps": 2, "eval.clients": False}
WIRE = {"distribute.insecure": True, "distribute.token": "t", "distribute.heartbeat_interval": 0.5,
        "distribute.heartbeat_timeout": 5.0, "distribute.backoff_max": 0.5}


def _records(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _simulate(tmp_path, keys):
    sim = tmp_path / "simulated"
    Course(small_cfg(sim, **{k.replace(".", "__"): v for k, v in keys.items()})).run()
    return sim


def _edge_port(out, edge_id, proc):
    f = address_file(out, edge_id)

    def ready():
        if proc.poll() is not None:
            raise AssertionError(f"edge {edge_id} exited with {proc.returncode}:\n{text(proc)[-3000:]}")
        return f.exists() and f.read_text().strip()
    return int(wait_for(ready, 90, f"edge {edge_id} to listen").rsplit(":", 1)[1])


def _tree(procs, cfg, out, edge_port=0):
    """The cloud, then edges 5 and 6, then clients 1-2 under edge 5 and 3-4 under edge 6."""
    cloud = procs.fedcore("cloud", cfg, "distribute.role=server", "distribute.server_port=0", f"outdir={out}")
    port = server_port(out, cloud)

    def edge(e, listen=0):
        return procs.fedcore(f"edge{e}", cfg, "distribute.role=edge", f"distribute.edge_id={e}",
                             f"distribute.cloud_port={port}", f"distribute.server_port={listen}",
                             f"outdir={out}")
    edges = {e: edge(e, edge_port) for e in (5, 6)}
    ports = {e: _edge_port(out, e, p) for e, p in edges.items()}
    clients = {k: procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.client_id={k}",
                                f"distribute.server_port={ports[5 if k <= 2 else 6]}")
               for k in (1, 2, 3, 4)}
    return cloud, edges, clients, ports, edge


def test_deployed_hierarchy_equals_the_simulation(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, **WIRE})
    out = tmp_path / "deployed"
    cloud, edges, clients, _, _ = _tree(procs, cfg, out)
    assert wait_exit(cloud, 180) == 0, text(cloud)[-3000:]
    for p in [*edges.values(), *clients.values()]:
        assert wait_exit(p, 60) == 0, text(p)[-3000:]
    assert "edge 5: course finished" in text(edges[5])

    sim = _simulate(tmp_path, COURSE)
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim / "final_model.pt", weights_only=True)
    for entry in simulated:
        assert torch.allclose(deployed[entry], simulated[entry], rtol=0, atol=1e-6), entry
    dep, sims = _records(out / "metrics.jsonl"), _records(sim / "metrics.jsonl")
    assert [r["round"] for r in dep] == [r["round"] for r in sims] == [1, 2]
    for d, s in zip(dep, sims):
        assert d["num_updates"] == s["num_updates"] == 2      # two edge models per cloud round
        assert d["bytes_edge_cloud"] == s["bytes_edge_cloud"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["topology"] == {"5": [1, 2], "6": [3, 4]}


# A round lasts at least a client's 0.5 s pause, so 40 rounds outlast the cloud noticing the
# killed edge (5 s) and the new edge process starting up.
ROUNDS = 40


def test_a_killed_edge_is_dropped_and_rejoins_when_it_comes_back(tmp_path, procs):
    """SIGKILL edge 6 after the first cloud round: the cloud drops it like a dead client and
    goes on with edge 5; edge 6 started again on its port is rejoined by clients 3 and 4 and
    rejoins the cloud, whose later rounds have two edge models again."""
    cfg = write_cfg(tmp_path / "course.yaml", {
        **COURSE, **WIRE, "federate.total_round_num": ROUNDS, "topology.edge_rounds": 1,
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.5, "distribute.retry_timeout": 60.0})
    out = tmp_path / "out"
    cloud, edges, clients, ports, edge = _tree(procs, cfg, out)
    wait_for(lambda: _records(out / "metrics.jsonl"), 120, "the first cloud round")
    edges[6].kill()   # no goodbye: the cloud must notice the silence
    again = edge(6, ports[6])   # on the port its clients redial; it starts up meanwhile
    wait_for(lambda: "client 6 lost" in text(cloud), 30, "the cloud to notice edge 6's death")
    assert wait_exit(cloud, 240) == 0, text(cloud)[-3000:]
    records = _records(out / "metrics.jsonl")
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    counts = [r["num_updates"] for r in records]
    first_alone = counts.index(1)
    assert 2 in counts[first_alone:], counts   # edge 6 came back into the course
    for p in (again, edges[5], *clients.values()):
        assert wait_exit(p, 60) == 0, text(p)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert any(e["client"] == 6 for e in summary["lost_clients"])


def test_launch_starts_the_edges(tmp_path, procs):
    """`fedcore.launch` with topology.edges: the cloud, one process per edge, each client
    dialling its edge with its own token (the cloud accepts only the edges'); the course equals
    its simulation."""
    keys = {**COURSE, "topology.assign": "random"}
    cfg = write_cfg(tmp_path / "course.yaml", {**keys, "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    log = text(launcher)
    assert "edge 5: course finished" in log and "edge 6: course finished" in log
    assert all(f"client {k}: course finished" in log for k in (1, 2, 3, 4))
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["deployment"]["clients"]) == ["5", "6"]   # only edges dialled the cloud
    sim = _simulate(tmp_path, keys)
    assert summary["topology"] == json.loads((sim / "summary.json").read_text())["topology"]
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim / "final_model.pt", weights_only=True)
    for entry in simulated:
        assert torch.allclose(deployed[entry], simulated[entry], rtol=0, atol=1e-6), entry


@pytest.mark.parametrize("assignment", ["by_label", "by_profile"])
def test_launch_refuses_an_assignment_no_deployed_process_can_make_in_one_line(tmp_path, procs, assignment):
    """by_label and by_profile read every client's data or device profile: the launcher, which
    holds neither, refuses them before starting anything, in one line (exit 2), as each
    deployed process would."""
    field = {"topology.profile_field": "latency"} if assignment == "by_profile" else {}
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, "topology.assign": assignment, **field})
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={tmp_path / 'out'}"])
    assert wait_exit(launcher, 120) == 2, text(launcher)[-3000:]
    lines = text(launcher).strip().splitlines()
    assert lines[-1].startswith(f"fedcore: topology.assign: {assignment} reads every client's data")
    assert "Traceback" not in text(launcher)


def test_launch_tokens_give_each_tier_only_its_own(tmp_path):
    """The launcher's tokens for a tree: the cloud accepts the edges' tokens only, each edge its
    own clients' only, and each edge alone holds the token the cloud accepts for it."""
    from fedcore.deployment.launch_tree import CLOUD_TOKEN_ENV, LaunchTree
    import yaml
    tree = LaunchTree(small_cfg(None, **{k.replace(".", "__"): v for k, v in COURSE.items()}), 4)
    clients = {k: f"client-token-{k}" for k in (1, 2, 3, 4)}
    cloud = tree.tokens(clients, tmp_path)
    assert sorted(cloud) == [5, 6] and not set(cloud.values()) & set(clients.values())
    for e, members in {5: [1, 2], 6: [3, 4]}.items():
        (option,) = tree.edge_extra[e]
        accepted = yaml.safe_load(open(option.split("=", 1)[1]))
        assert accepted == {c: clients[c] for c in members}
        assert tree.edge_env[e][CLOUD_TOKEN_ENV] == cloud[e]
        assert (tmp_path / f"tokens_of_edge_{e}.yaml").stat().st_mode & 0o077 == 0
