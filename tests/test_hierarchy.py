"""Hierarchical courses (HierFAVG): limiting cases against flat FedAvg, kappa counts, a
hand-computed two-edge course, per-tier bytes and link time from their formulas, and the
topology's assignment and refusals."""
import json

import pytest
import torch

from fedcore.runtime.admission import AdmissionState
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError, IncompleteCourseError
from fedcore.scenarios.data import ClientData, FederatedData, Split
from fedcore.runtime.topology import Topology, assign, check
from tests.conftest import small_cfg


def _records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _final(path):
    return torch.load(path / "final_model.pt", weights_only=True)


def _run(path, **over):
    return Course(small_cfg(path, eval__clients=False, **over)).run()


@pytest.mark.parametrize("sampled", [None, 4])
def test_one_edge_with_one_edge_round_is_flat_fedavg_exactly(tmp_path, sampled):
    """One edge, kappa_2 = 1: the edge averages what the flat server would, and the cloud's
    average of that one model is the model itself, so every round's model is bit-equal."""
    common = dict(federate__total_round_num=3, federate__sample_client_num=sampled)
    _run(tmp_path / "flat", **common)
    _run(tmp_path / "tree", topology__edges=1, **common)
    flat, tree = _final(tmp_path / "flat"), _final(tmp_path / "tree")
    assert all(torch.equal(flat[k], tree[k]) for k in flat)
    for a, b in zip(_records(tmp_path / "flat"), _records(tmp_path / "tree")):
        assert (a["round"], a["test_loss"], a["test_acc"]) == (b["round"], b["test_loss"], b["test_acc"])


def test_a_server_optimizer_steps_at_the_cloud_only(tmp_path):
    """FedAvg at the edge, FedAvgM at the cloud: with one edge and kappa_2 = 1 the cloud's
    pseudo-gradient is flat FedAvg's, so the course equals flat FedAvgM exactly."""
    common = dict(federate__total_round_num=3, server_optimizer__type="sgdm",
                  server_optimizer__momentum=0.5)
    _run(tmp_path / "flat", **common)
    _run(tmp_path / "tree", topology__edges=1, **common)
    _run(tmp_path / "plain", topology__edges=1, federate__total_round_num=3)
    flat, tree, plain = (_final(tmp_path / n) for n in ("flat", "tree", "plain"))
    assert all(torch.equal(flat[k], tree[k]) for k in flat)
    assert not all(torch.equal(plain[k], tree[k]) for k in flat)   # the momentum did act


def test_many_edges_with_one_edge_round_is_flat_fedavg(tmp_path):
    """kappa_2 = 1, full participation: sum_l (|D_l|/|D|) sum_{i in l} (|D_i|/|D_l|) w_i =
    sum_i (|D_i|/|D|) w_i, flat FedAvg's average (equal up to float rounding)."""
    common = dict(federate__total_round_num=3, train__local_steps=2)
    _run(tmp_path / "flat", **common)
    _run(tmp_path / "tree", topology__edges=3, topology__assign="random", **common)
    flat, tree = _final(tmp_path / "flat"), _final(tmp_path / "tree")
    assert all(torch.allclose(flat[k], tree[k], atol=1e-6, rtol=0) for k in flat)


def test_kappa_counts(tmp_path, monkeypatch):
    """kappa_1 = 3 local steps, kappa_2 = 2 edge rounds, 2 cloud rounds, 2 edges over 6 clients:
    each client trains R*kappa_2 = 4 times, kappa_1 steps each; each edge aggregates 4 times;
    the cloud 2 times (one record each), and the clients' rounds run 1..4."""
    course = Course(small_cfg(tmp_path, eval__clients=False, federate__total_round_num=2,
                              train__local_steps=3, topology__edges=2, topology__edge_rounds=2)).build()
    fits, steps = [], [0]
    fit, step = course.trainer.fit, course.trainer.step

    def counting_fit(cid, data, received, round_):
        fits.append((cid, round_))
        return fit(cid, data, received, round_)

    def counting_step(x, y):
        steps[0] += 1
        return step(x, y)
    monkeypatch.setattr(course.trainer, "fit", counting_fit)
    monkeypatch.setattr(course.trainer, "step", counting_step)
    edge_aggs = {e: 0 for e in course.edges}
    for e, edge in course.edges.items():
        agg = edge.aggregator.aggregate

        def counted(updates, round_, e=e, agg=agg):
            edge_aggs[e] += 1
            return agg(updates, round_)
        monkeypatch.setattr(edge.aggregator, "aggregate", counted)
    course.run()
    assert sorted(fits) == sorted((c, t) for c in range(1, 7) for t in (1, 2, 3, 4))
    assert steps[0] == 6 * 2 * 2 * 3
    assert edge_aggs == {7: 4, 8: 4}
    assert [r["round"] for r in _records(tmp_path)] == [1, 2]
    assert [r["num_updates"] for r in _records(tmp_path)] == [2, 2]


def _line_data(points):
    """Clients holding (x, y) points for y ~ w x + b, in float64."""
    def split(pts):
        return Split(torch.tensor([[x] for x, _ in pts], dtype=torch.float64).reshape(-1, 1),
                     torch.tensor([y for _, y in pts], dtype=torch.float64))
    empty = split([])
    clients = {c: ClientData(split(pts), empty, empty) for c, pts in points.items()}
    return FederatedData(clients, split([(1.0, 1.0), (2.0, 0.0)]), (1,), 1)


def test_two_edges_by_hand(tmp_path):
    """Four clients with 1, 2, 3, 1 points under two edges; one full-batch SGD step on the mean
    squared error per edge round (kappa_1 = 1), kappa_2 = 2, one cloud round; computed here
    from the update rule w <- w - lr * 2/n sum (w x + b - y) x, b <- b - lr * 2/n sum (w x + b - y)."""
    points = {1: [(1.0, 2.0)], 2: [(0.0, 1.0), (2.0, -1.0)],
              3: [(1.0, 0.5), (-1.0, 1.5), (3.0, 2.0)], 4: [(0.5, 3.0)]}
    lr = 0.1
    cfg = small_cfg(tmp_path, eval__clients=False, federate__client_num=4, federate__total_round_num=1,
                    train__local_steps=1, train__batch_size=8, train__optimizer__lr=lr,
                    train__loss="mse", model__dtype="float64", topology__edges=2,
                    topology__edge_rounds=2)
    course = Course(cfg).build(data=_line_data(points))
    start = course.server.aggregator.global_state
    w0, b0 = start["1.weight"].item(), start["1.bias"].item()
    course.run()

    def sgd(w, b, pts):
        n = len(pts)
        r = [w * x + b - y for x, y in pts]
        return (w - lr * 2 / n * sum(ri * x for ri, (x, _) in zip(r, pts)),
                b - lr * 2 / n * sum(r))

    def edge(members, w, b):
        for _ in range(2):   # kappa_2 edge rounds, each from the edge's model
            models = [(sgd(w, b, points[c]), len(points[c])) for c in members]
            total = sum(n for _, n in models)
            w = sum(m[0] * n for m, n in models) / total
            b = sum(m[1] * n for m, n in models) / total
        return w, b
    (wa, ba), (wb, bb) = edge([1, 2], w0, b0), edge([3, 4], w0, b0)
    w, b = (3 * wa + 4 * wb) / 7, (3 * ba + 4 * bb) / 7     # |D_A| = 3, |D_B| = 4
    final = _final(tmp_path)
    assert final["1.weight"].item() == pytest.approx(w, abs=1e-12)
    assert final["1.bias"].item() == pytest.approx(b, abs=1e-12)
    assert course.topology.edges == {5: [1, 2], 6: [3, 4]}


def test_tier_bytes_grow_by_params_times_4_per_model_message(tmp_path):
    """Two courses that differ only in the model's size (dim 40 and 80, 3 classes: 123 and 243
    float32 parameters): each tier's bytes differ by 120 x 4 bytes per model message, and the
    model messages are R*E*2 on the edge-cloud tier and R*kappa_2*N*2 on the client-edge tier."""
    R, E, K2, N = 2, 2, 3, 6
    sizes = {}
    for dim in (40, 80):
        s = _run(tmp_path / str(dim), federate__total_round_num=R, data__synthetic__dim=dim,
                 topology__edges=E, topology__edge_rounds=K2)
        sizes[dim] = {t: v["bytes_up"] + v["bytes_down"] for t, v in s["tiers"].items()}
    per_message = (243 - 123) * 4
    assert sizes[80]["edge_cloud"] - sizes[40]["edge_cloud"] == per_message * R * E * 2
    assert sizes[80]["client_edge"] - sizes[40]["client_edge"] == per_message * R * K2 * N * 2


def test_tier_bytes_and_link_seconds_match_the_messages(tmp_path):
    """Every message is counted on its tier: the tiers add up to the run's bytes; the edge
    link's seconds are latency per message plus bytes over its bandwidth each way."""
    lat, up, down = 0.2, 5000.0, 20000.0
    s = _run(tmp_path, federate__total_round_num=2, topology__edges=2, topology__edge_rounds=2,
             topology__edge_link__latency=lat, topology__edge_link__upload_bandwidth=up,
             topology__edge_link__download_bandwidth=down)
    tiers = s["tiers"]
    assert sum(t["bytes_up"] for t in tiers.values()) == s["bytes_up"]
    assert sum(t["bytes_down"] for t in tiers.values()) == s["bytes_down"]
    ec = tiers["edge_cloud"]
    messages = 2 + 2 * 2 + 2 * 2 + 2       # joins, models, updates, finish
    assert ec["link_seconds"] == pytest.approx(messages * lat + ec["bytes_up"] / up
                                               + ec["bytes_down"] / down, rel=1e-12)
    last = _records(tmp_path)[-1]
    assert last["bytes_edge_cloud_total"] + last["bytes_client_edge_total"] == last["bytes_total"]


def test_contiguous_and_by_label_assignment():
    cfg = small_cfg(federate__client_num=7, topology__edges=3)
    assert assign(cfg, list(range(1, 8))).edges == {8: [1, 2, 3], 9: [4, 5], 10: [6, 7]}

    class Labels:   # clients whose majority labels are 2, 0, 1, 0
        clients = {c: ClientData(Split(torch.zeros(3, 1), torch.tensor(y)), None, None)
                   for c, y in {1: [2, 2, 1], 2: [0, 0, 1], 3: [1, 1, 1], 4: [0, 2, 0]}.items()}
    cfg = small_cfg(federate__client_num=4, topology__edges=2, topology__assign="by_label")
    assert assign(cfg, [1, 2, 3, 4], Labels).edges == {5: [2, 4], 6: [1, 3]}


def test_random_assignment_is_seeded_and_covers_every_client():
    cfg = small_cfg(federate__client_num=10, topology__edges=3, topology__assign="random")
    a, b = assign(cfg, list(range(1, 11))), assign(cfg, list(range(1, 11)))
    assert a.edges == b.edges
    assert sorted(c for m in a.edges.values() for c in m) == list(range(1, 11))


def test_topology_refusals():
    with pytest.raises(IncompleteCourseError, match="edge"):
        check(Topology({7: [1, 2], 8: []}), [1, 2])
    with pytest.raises(IncompleteCourseError, match="client"):
        check(Topology({7: [1, 2]}), [1, 2, 3])
    with pytest.raises(ConfigError, match="topology.edges"):
        small_cfg(federate__client_num=3, topology__edges=4)
    with pytest.raises(ConfigError, match="algorithm"):
        Course(small_cfg(topology__edges=2, algorithm__name="scaffold")).build()
    with pytest.raises(ConfigError, match="profile_field"):
        small_cfg(topology__edges=2, topology__assign="by_profile")


def test_the_check_draws_the_tiers(tmp_path):
    """`--check` passes and the written graph holds the tree beside the handler flow."""
    import networkx as nx
    course = Course(small_cfg(tmp_path, topology__edges=2)).build()
    course.write_header()
    course.check()
    g = nx.read_graphml(tmp_path / "message_flow.graphml")
    assert g.has_edge("tier:cloud", "tier:edge:7") and g.has_edge("tier:edge:8", "tier:client:6")
    assert g.has_edge("edge:receiving_models", "client:receiving_models")


def test_the_scenario_from_the_command_line_writes_tiers(tmp_path):
    """`python -m fedcore.run --cfg scenarios/hierarchical.yaml` (two cloud rounds here) writes
    per-tier bytes and link time in every record and in the summary."""
    from tests.deploy_helpers import ROOT, run_fedcore
    out = tmp_path / "run"
    done = run_fedcore(["--cfg", "scenarios/hierarchical.yaml", f"outdir={out}", "federate.total_round_num=2",
                        "verbose=0"], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["tiers"]) == {"client_edge", "edge_cloud"}
    assert all(t["bytes_up"] > 0 and t["bytes_down"] > 0 and t["link_seconds"] > 0
               for t in summary["tiers"].values())
    assert len(summary["topology"]) == 3
    for record in _records(out):
        assert record["bytes_edge_cloud"] > 0 and record["link_seconds_edge_cloud"] > 0
        assert record["bytes_client_edge"] > record["bytes_edge_cloud"]


def test_by_profile_assignment_sorts_by_the_field():
    """Latency profiles from a trace-like constant per client: clients sorted by latency, cut."""
    from fedcore.runtime.timing import DeviceProfile, TimeModel
    latency = {1: 0.3, 2: 0.1, 3: 0.4, 4: 0.2}
    timing = TimeModel({c: DeviceProfile(latency=v) for c, v in latency.items()})
    cfg = small_cfg(federate__client_num=4, topology__edges=2, topology__assign="by_profile",
                    topology__profile_field="latency")
    assert assign(cfg, [1, 2, 3, 4], None, timing).edges == {5: [2, 4], 6: [1, 3]}


def test_an_edge_refuses_an_update_claiming_more_than_its_client_declared(tmp_path, monkeypatch):
    """The admission layer runs at the edge: client 2 claiming 10x its declared samples is
    refused there, and counted in the summary, while the course goes on."""
    from fedcore.kernel import contract
    fit = contract.Trainer.fit

    def inflating(self, client_id, data, received, round_):
        result = fit(self, client_id, data, received, round_)
        if client_id == 2:
            result.content["num_samples"] *= 10
        return result
    monkeypatch.setattr(contract.Trainer, "fit", inflating)
    s = _run(tmp_path, topology__edges=2)
    assert s["admission"] == {"num_samples above the declared count": 2}
    assert [r["num_updates"] for r in _records(tmp_path)] == [2, 2]


def test_median_at_the_edges_by_hand(tmp_path):
    """topology.edge_robust_rule=median, FedAvg at the cloud: six clients (1, 2, 3, 1, 2, 1 points)
    under two edges of three, one SGD step each (kappa_1 = kappa_2 = 1), one cloud round. Each edge
    takes the coordinate median of its three clients' models (the middle value, whatever their
    sample counts); the cloud averages the two edge models by |D_l| = 6 and 4."""
    points = {1: [(1.0, 2.0)], 2: [(0.0, 1.0), (2.0, -1.0)], 3: [(1.0, 0.5), (-1.0, 1.5), (3.0, 2.0)],
              4: [(0.5, 3.0)], 5: [(2.0, 2.0), (-2.0, 0.0)], 6: [(4.0, -1.0)]}
    lr = 0.1
    cfg = small_cfg(tmp_path, eval__clients=False, federate__client_num=6, federate__total_round_num=1,
                    train__local_steps=1, train__batch_size=8, train__optimizer__lr=lr,
                    train__loss="mse", model__dtype="float64", topology__edges=2,
                    topology__edge_robust_rule="median")
    course = Course(cfg).build(data=_line_data(points))
    start = course.server.aggregator.global_state
    w0, b0 = start["1.weight"].item(), start["1.bias"].item()
    course.run()

    def sgd(pts):
        r = [w0 * x + b0 - y for x, y in pts]
        return w0 - lr * 2 / len(pts) * sum(ri * x for ri, (x, _) in zip(r, pts)), b0 - lr * 2 / len(pts) * sum(r)

    def middle(values):
        return sorted(values)[1]
    edges = {}
    for e, members in ((7, [1, 2, 3]), (8, [4, 5, 6])):
        models = [sgd(points[c]) for c in members]
        edges[e] = (middle([m[0] for m in models]), middle([m[1] for m in models]))
    w = (6 * edges[7][0] + 4 * edges[8][0]) / 10
    b = (6 * edges[7][1] + 4 * edges[8][1]) / 10
    final = _final(tmp_path)
    assert final["1.weight"].item() == pytest.approx(w, abs=1e-12)
    assert final["1.bias"].item() == pytest.approx(b, abs=1e-12)


def test_one_edge_with_an_edge_rule_is_the_flat_rule(tmp_path):
    """One edge, kappa_2 = 1: trimmed mean at the edge equals the flat course's trimmed mean
    (the cloud's average of one model is that model)."""
    common = dict(federate__total_round_num=2, aggregator__trim_ratio=0.2)
    _run(tmp_path / "flat", aggregator__robust_rule="trimmed_mean", **common)
    _run(tmp_path / "tree", topology__edges=1, topology__edge_robust_rule="trimmed_mean", **common)
    _run(tmp_path / "plain", topology__edges=1, **common)
    flat, tree, plain = (_final(tmp_path / n) for n in ("flat", "tree", "plain"))
    assert all(torch.allclose(flat[k], tree[k], atol=1e-7, rtol=0) for k in flat)
    assert not all(torch.allclose(plain[k], tree[k], atol=1e-4, rtol=0) for k in flat)


def test_deployed_tree_refusals():
    """Deployed, the tree comes from ids alone, clients are evaluated by nobody, and an edge's id
    follows the clients'."""
    base = dict(topology__edges=2, eval__clients=False, distribute__role="edge", distribute__edge_id=7)
    small_cfg(None, **base)
    for bad, words in ((dict(topology__assign="by_label"), "topology.assign"),
                       (dict(eval__clients=True), "eval.clients"),
                       (dict(distribute__edge_id=6), "distribute.edge_id"),
                       (dict(distribute__edge_id=9), "distribute.edge_id")):
        with pytest.raises(ConfigError, match=words):
            small_cfg(None, **{**base, **bad})
    with pytest.raises(ConfigError, match="topology.edge_robust_rule"):
        small_cfg(None, topology__edge_robust_rule="median")


def _line_course(tmp_path, points, **over):
    """A float64 linear regression over `points`, one full-batch SGD step per training."""
    cfg = small_cfg(tmp_path, eval__clients=False, federate__client_num=len(points), train__local_steps=1,
                    train__batch_size=8, train__optimizer__lr=0.1, train__loss="mse",
                    model__dtype="float64", **over)
    course = Course(cfg).build(data=_line_data(points))
    start = course.server.aggregator.global_state
    return course, (start["1.weight"].item(), start["1.bias"].item())


def _sgd(w, b, pts, lr=0.1):
    r = [w * x + b - y for x, y in pts]
    return w - lr * 2 / len(pts) * sum(ri * x for ri, (x, _) in zip(r, pts)), b - lr * 2 / len(pts) * sum(r)


def _fedavg(members, points, w, b):
    models = [(_sgd(w, b, points[c]), len(points[c])) for c in members]
    total = sum(n for _, n in models)
    return (sum(m[0] * n for m, n in models) / total, sum(m[1] * n for m, n in models) / total)


POINTS = {1: [(1.0, 2.0)], 2: [(0.0, 1.0), (2.0, -1.0)], 3: [(1.0, 0.5), (-1.0, 1.5), (3.0, 2.0)],
          4: [(0.5, 3.0)]}


def test_fedbuff_at_the_cloud_by_hand(tmp_path):
    """FedBuff at the cloud (K = 2 = both edges, eta_g = 0.5), FedAvg at the edges: every cloud
    round both edges start from w_r, so w_{r+1} = w_r + 0.5 * (1/2) (Delta_A + Delta_B) with
    Delta_l = FedAvg_l(w_r) - w_r; two cloud rounds by hand."""
    course, (w, b) = _line_course(tmp_path, POINTS, federate__total_round_num=2, topology__edges=2,
                                  topology__cloud_aggregator="fedbuff", topology__cloud_buffer=2,
                                  algorithm__fedbuff__server_lr=0.5)
    course.run()
    for _ in range(2):
        (wa, ba), (wb, bb) = _fedavg([1, 2], POINTS, w, b), _fedavg([3, 4], POINTS, w, b)
        w, b = w + 0.25 * ((wa - w) + (wb - w)), b + 0.25 * ((ba - b) + (bb - b))
    final = _final(tmp_path)
    assert final["1.weight"].item() == pytest.approx(w, abs=1e-12)
    assert final["1.bias"].item() == pytest.approx(b, abs=1e-12)
    assert [r["staleness_max"] for r in _records(tmp_path)] == [0, 0]


def test_fedasync_at_the_cloud_with_one_edge_by_hand(tmp_path):
    """FedAsync at the cloud (alpha = 0.3), one edge: w_{r+1} = 0.7 w_r + 0.3 FedAvg(w_r)."""
    course, (w, b) = _line_course(tmp_path, POINTS, federate__total_round_num=3, topology__edges=1,
                                  topology__cloud_aggregator="fedasync", algorithm__fedasync__alpha=0.3)
    course.run()
    for _ in range(3):
        wa, ba = _fedavg([1, 2, 3, 4], POINTS, w, b)
        w, b = 0.7 * w + 0.3 * wa, 0.7 * b + 0.3 * ba
    final = _final(tmp_path)
    assert final["1.weight"].item() == pytest.approx(w, abs=1e-12)
    assert final["1.bias"].item() == pytest.approx(b, abs=1e-12)


def test_an_async_cloud_takes_edges_as_they_come(tmp_path):
    """FedAsync at the cloud with K = 1 and two edges: each cloud round is one edge's model, and
    the edge not heard from works on an older model, so its update arrives one round stale."""
    _run(tmp_path, federate__total_round_num=4, topology__edges=2, topology__cloud_aggregator="fedasync")
    records = _records(tmp_path)
    assert [r["num_updates"] for r in records] == [1, 1, 1, 1]
    assert max(r["staleness_max"] for r in records) >= 1


def test_async_cloud_refusals():
    for bad, words in ((dict(topology__cloud_buffer=3), "topology.cloud_buffer"),
                       (dict(aggregator__robust_rule="median"), "topology.cloud_aggregator"),
                       (dict(server_optimizer__type="adam"), "topology.cloud_aggregator"),
                       (dict(distribute__role="server", distribute__insecure=True, eval__clients=False),
                        "simulation only")):
        with pytest.raises(ConfigError, match=words):
            small_cfg(None, topology__edges=2, topology__cloud_aggregator="fedbuff", **bad)


def test_an_edge_ignores_a_join_from_another_edges_client(tmp_path):
    """Deployed with one shared token, any client could dial any edge: an edge counts only its
    own clients' joins (the rest is noted in the summary's admission counts), and the cloud only
    edges'."""
    from fedcore.kernel.message import Message
    course = Course(small_cfg(tmp_path, eval__clients=False, topology__edges=2)).build()
    edge = course.edges[7]                       # clients 1-3; client 4 is edge 8's
    edge.deliver(Message("join_in", 4, (7,), 0, 0.0, {"client_id": 4, "num_samples": 10**6}))
    course.server.deliver(Message("join_in", 2, (0,), 0, 0.0, {"client_id": 2, "num_samples": 30}))
    assert edge.joined == set() and 4 not in edge.state(AdmissionState).declared
    assert course.server.joined == set()
    counts = course.monitor.extra_summary["admission"]
    assert counts == {"join from a client of another edge": 1, "join from a worker that is not an edge": 1}
