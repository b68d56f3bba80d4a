"""Edges are token holders, not the operator: a hostile edge built from the project's own edge
(tests/hostile_edge.py: it joins at once, with no client's work, and answers every cloud model
with a poisoned one) against the cloud's bound on what an edge may declare, its admission
layer and its robust rules; and what honest edges declare when a client lies or all of an
edge's clients' updates are refused.

The expected models are computed here from the update rule on a float64 linear regression,
as tests/test_hierarchy.py does: w <- w - lr 2/n sum (w x + b - y) x, b <- b - lr 2/n sum (w x + b - y).
"""
import pytest
import torch

from fedcore.runtime.admission import AdmissionState
from fedcore.runtime.course import Course
from fedcore.scenarios.data import FederatedData
from tests.conftest import small_cfg
from tests.hostile_edge import DECLARED, bias_poison, hostile_table
from tests.test_hierarchy import POINTS, _fedavg, _line_course, _records

# six clients with 1, 2, 3, 1, 2, 1 points under edges 7: [1, 2], 8: [3, 4], 9: [5, 6]
POINTS6 = {1: [(1.0, 2.0)], 2: [(0.0, 1.0), (2.0, -1.0)], 3: [(1.0, 0.5), (-1.0, 1.5), (3.0, 2.0)],
           4: [(0.5, 3.0)], 5: [(2.0, 2.0), (-2.0, 0.0)], 6: [(4.0, -1.0)]}
# each edge's bound: its clients count for at most the largest partition among them (no
# admission.max_num_samples), so 2 x max(|D_i|): 2 x 2, 2 x 3, 2 x 2
BOUNDS = {7: 4, 8: 6, 9: 4}
HONEST = {7: 3, 8: 4}   # |D_7| = 1 + 2, |D_8| = 3 + 1
ROUNDS = 2
POISON = 50.0


def _shifted(model: dict) -> dict:
    return {k: t + POISON for k, t in model.items()}


def _final(path):
    f = torch.load(path / "final_model.pt", weights_only=True)
    return f["1.weight"].item(), f["1.bias"].item()


def _hostile_course(tmp_path, declared, claimed, **over):
    course, start = _line_course(tmp_path, POINTS6, federate__total_round_num=ROUNDS, topology__edges=3,
                                 **over)
    course.edges[9].handlers = hostile_table(declared, claimed, _shifted)
    return course, start


def _honest_round(w, b):
    """One cloud round over edges 7 and 8 only, weighted |D_7| = 3, |D_8| = 4."""
    (w7, b7), (w8, b8) = _fedavg([1, 2], POINTS6, w, b), _fedavg([3, 4], POINTS6, w, b)
    return (3 * w7 + 4 * w8) / 7, (3 * b7 + 4 * b8) / 7


def test_the_cloud_bounds_each_edge_by_its_clients(tmp_path):
    course, _ = _line_course(tmp_path, POINTS6, topology__edges=3)
    assert course.topology.edges == {7: [1, 2], 8: [3, 4], 9: [5, 6]}
    assert course.server.state(AdmissionState).bounds == BOUNDS


def test_an_edge_declaring_1e9_samples_is_refused_at_the_join_and_never_aggregated(tmp_path, caplog):
    """The tester's edge: 10^9 samples declared, no client, a poisoned model (+50 on every entry)
    every round. Its declaration is refused at the join (one line naming it), it counts for 0
    samples, so each of its updates is refused, and the course is the honest edges' alone."""
    course, (w, b) = _hostile_course(tmp_path, DECLARED, DECLARED)
    with caplog.at_level("WARNING", logger="fedcore.admission"):
        summary = course.run()
    refusals = [r.getMessage() for r in caplog.records if "declaration" in r.getMessage()]
    assert len(refusals) == 1 and "edge 9" in refusals[0] and str(DECLARED) in refusals[0]
    assert summary["admission"] == {"edge declaration above its clients' bound": 1,
                                    "num_samples above the declared count": ROUNDS}
    for _ in range(ROUNDS):
        w, b = _honest_round(w, b)
    assert _final(tmp_path) == pytest.approx((w, b), abs=1e-12)
    assert [r["num_updates"] for r in _records(tmp_path)] == [2] * ROUNDS


def _expected_within_bound(rule, w, b):
    """One cloud round with edge 9 sending (w + 50, b + 50) for 4 samples, its whole bound."""
    (w7, b7), (w8, b8) = _fedavg([1, 2], POINTS6, w, b), _fedavg([3, 4], POINTS6, w, b)
    pw, pb = w + POISON, b + POISON
    if rule == "none":        # its share is B_9 / (|D_7| + |D_8| + B_9) = 4 / 11
        return (3 * w7 + 4 * w8 + 4 * pw) / 11, (3 * b7 + 4 * b8 + 4 * pb) / 11
    if rule == "median":      # the middle of three, coordinate by coordinate
        return sorted([w7, w8, pw])[1], sorted([b7, b8, pb])[1]
    return (3 * w7 + 4 * w8) / 7, (3 * b7 + 4 * b8) / 7   # refused by the norm rule


@pytest.mark.parametrize("rule, over, refused", [
    ("none", {}, {}),
    ("median", {"aggregator__robust_rule": "median"}, {}),
    ("norm", {"admission__norm_ratio": 10.0}, {"update norm far above the round's others": ROUNDS}),
])
def test_an_edge_within_its_bound_is_screened_as_a_client_is(tmp_path, rule, over, refused):
    """The same edge declaring exactly its bound (4) is admitted, and what it can still do is
    bounded: without screening its poisoned model weighs B_9 / (sum of weights) = 4/11; the
    cloud's robust rule (median) and admission's norm rule apply to edges as to clients."""
    course, (w, b) = _hostile_course(tmp_path, BOUNDS[9], BOUNDS[9], **over)
    summary = course.run()
    assert summary.get("admission", {}) == refused
    for _ in range(ROUNDS):
        w, b = _expected_within_bound(rule, w, b)
    assert _final(tmp_path) == pytest.approx((w, b), abs=1e-12)


@pytest.mark.parametrize("how", ["gone", "refused"])
def test_an_edge_with_no_contributing_client_counts_for_nothing(tmp_path, monkeypatch, how):
    """Edge 9's clients 5 and 6 are gone once they have joined (no longer among the course's
    live clients when a cloud round starts, as a deployed edge's lost clients), or claim 10x
    the samples they declared and are refused at edge 9 every round. Either way edge 9 admits
    no client's work; it sends num_samples 0 and the cloud leaves its model (the cloud's own,
    back) out: the course is edges 7 and 8's alone, not held back by edge 9."""
    from fedcore.kernel import contract
    fit = contract.Trainer.fit

    def inflating(self, client_id, data, received, round_):
        result = fit(self, client_id, data, received, round_)
        if client_id in (5, 6):
            result.content["num_samples"] *= 10
        return result
    course, (w, b) = _line_course(tmp_path, POINTS6, federate__total_round_num=ROUNDS, topology__edges=3)
    if how == "gone":
        from fedcore.handlers.edge import start_edge_rounds

        def after_5_and_6_left(edge, msg):
            course.client_ids = [1, 2, 3, 4]
            start_edge_rounds(edge, msg)
        course.edges[9].handlers.register("receiving_models", after_5_and_6_left,
                                          sends=("models", "all_received"))
    else:
        monkeypatch.setattr(contract.Trainer, "fit", inflating)
    summary = course.run()
    refused = {"num_samples above the declared count": 2 * ROUNDS} if how == "refused" else None
    assert summary.get("admission") == refused
    for _ in range(ROUNDS):
        w, b = _honest_round(w, b)
    assert _final(tmp_path) == pytest.approx((w, b), abs=1e-12)
    assert [r["num_updates"] for r in _records(tmp_path)] == [2] * ROUNDS


def test_a_client_declaring_1e9_raises_its_edge_only_to_the_bound(tmp_path):
    """Client 1 (1 point) declares 10^9 at its join: its edge counts it for at most the edge's
    cap on one client, max(1, 2) = 2, so edge 5 declares 2 + 2 = 4 = its bound and is not
    refused; the cloud weighs edges 5 and 6 by 4 and 3 + 1 = 4."""
    course, (w, b) = _line_course(tmp_path, POINTS, federate__total_round_num=1, topology__edges=2)

    def declare_1e9(client, _event):
        n = DECLARED if client.id == 1 else len(client.data.train)
        client.send("join_in", client.parent, {"client_id": client.id, "num_samples": n})
    course.client_table.register("start", declare_1e9, sends=("join_in",))
    summary = course.run()
    assert "admission" not in summary
    assert course.server.state(AdmissionState).declared == {5: 4, 6: 4}
    (w5, b5), (w6, b6) = _fedavg([1, 2], POINTS, w, b), _fedavg([3, 4], POINTS, w, b)
    assert _final(tmp_path) == pytest.approx(((4 * w5 + 4 * w6) / 8, (4 * b5 + 4 * b6) / 8), abs=1e-12)


def test_max_num_samples_caps_each_client_at_its_edge_and_bounds_the_edge(tmp_path):
    """admission.max_num_samples = 2 with edges 5: [1, 2] and 6: [3, 4] (1, 2, 3, 1 points):
    each edge may declare 2 x 2 = 4; client 3's updates (3 samples) are refused at edge 6, which
    averages client 4's model alone and declares min(3, 2) + 1 = 3, as edge 5 declares 1 + 2."""
    course, (w, b) = _line_course(tmp_path, POINTS, federate__total_round_num=1, topology__edges=2,
                                  admission__max_num_samples=2)
    summary = course.run()
    assert course.server.state(AdmissionState).bounds == {5: 4, 6: 4}
    assert summary["admission"] == {"num_samples above admission.max_num_samples": 1}
    (w5, b5), (w6, b6) = _fedavg([1, 2], POINTS, w, b), _fedavg([4], POINTS, w, b)
    assert _final(tmp_path) == pytest.approx(((3 * w5 + 3 * w6) / 6, (3 * b5 + 3 * b6) / 6), abs=1e-12)


def _without(data: FederatedData, dropped: set[int]) -> FederatedData:
    return FederatedData({c: d for c, d in data.clients.items() if c not in dropped}, data.server_test,
                         data.input_shape, data.num_classes)


def test_the_hostile_edge_does_not_move_accuracy(tmp_path):
    """The tester's attack on a classification course (6 clients, 3 edges, 3 rounds): edge 9
    declares 10^9 and moves the class biases +5/-5 a round. The course ends on the model of
    flat FedAvg over the honest edges' clients 1-4 (kappa_2 = 1, full participation: equal up
    to float rounding), with its accuracy. Against a cloud that accepted the declaration (its
    bound lifted by hand) the same edge takes the model over: every test point is put in class 0."""
    common = dict(eval__clients=False, federate__total_round_num=3)
    cfg = small_cfg(tmp_path / "attacked", topology__edges=3, **common)
    course = Course(cfg).build()
    data = course.data
    course.edges[9].handlers = hostile_table(DECLARED, DECLARED, bias_poison)
    course.run()
    honest_cfg = small_cfg(tmp_path / "honest", federate__client_num=4, **common)
    Course(honest_cfg).build(data=_without(data, {5, 6})).run()
    attacked, honest = (torch.load(tmp_path / n / "final_model.pt", weights_only=True)
                        for n in ("attacked", "honest"))
    assert all(torch.allclose(attacked[k], honest[k], atol=1e-5, rtol=0) for k in honest)
    accuracy = [[r["test_acc"] for r in _records(tmp_path / n)] for n in ("attacked", "honest")]
    assert accuracy[0] == accuracy[1]

    lifted = Course(small_cfg(tmp_path / "lifted", topology__edges=3, **common)).build()
    lifted.edges[9].handlers = hostile_table(DECLARED, DECLARED, bias_poison)
    lifted.server.state(AdmissionState).bounds[9] = DECLARED   # the cloud before the bound
    lifted.run()
    class0 = float((data.server_test.y == 0).double().mean())
    assert _records(tmp_path / "lifted")[-1]["test_acc"] == pytest.approx(class0)
    assert class0 < accuracy[1][-1]
