"""Admission rules by hand, divergence in simulation, strict JSON, rate-limited refusals."""
import json
import logging
import math

import pytest
import torch

from fedcore.runtime.admission import AdmissionState, Snapshot, admit_updates, finite_state, medians_of_others
from fedcore.runtime.quiet import QuietLog
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.runtime.course import Course
from fedcore.kernel.errors import EXIT_DIVERGED, CourseDiverged
from fedcore.runtime.monitor import Monitor, strict_json
from tests.conftest import small_cfg
from fedcore.kernel.server_state import Outcome, StateHolder, WorkerStates
from tests.deploy_helpers import ROOT, _env, write_cfg, run_fedcore


class _Course:
    def __init__(self, wall_clock=True, **cfg):
        self.cfg = small_cfg(None, **cfg)
        self.monitor = Monitor(None)
        self.wall_clock = wall_clock


class _Aggregator:
    def __init__(self, state):
        self.global_state = state

    def state_dict(self):
        return {}


class _Server(StateHolder):
    def __init__(self, course, state, declared=None):
        self.course, self.round = course, 3
        self.aggregator = _Aggregator(state)
        self.states = WorkerStates()
        self.state(AdmissionState).declared = declared or {}


def _update(cid, w, n=10):
    return ReceivedUpdate(cid, {"model": {"w": torch.tensor(w, dtype=torch.float32)}, "num_samples": n}, 3, 0)


def test_norm_rule_refuses_an_update_far_from_the_others_by_hand():
    server = _Server(_Course(admission__norm_ratio=10.0), {"w": torch.tensor([1.0, 1.0])})
    # distances from the global model: 1, 2, 5, and 30 (norm of (18, 24))
    ups = [_update(1, [2.0, 1.0]), _update(2, [1.0, 3.0]), _update(3, [4.0, 5.0]), _update(4, [19.0, 25.0])]
    kept = admit_updates(server, ups)
    # client 4: 30 > 10 x median(1, 2, 5) = 20 -> refused; client 3: 5 <= 10 x median(1, 2, 30) = 20
    assert [u.client_id for u in kept] == [1, 2, 3]
    assert server.course.monitor.extra_summary["admission"] == {"update norm far above the round's others": 1}
    ups[3] = _update(4, [13.0, 17.0])  # distance |(12, 16)| = 20 exactly -> admitted (the bound is inclusive)
    assert len(admit_updates(server, ups)) == 4


@pytest.mark.parametrize("wall_clock", [True, False], ids=["deployment", "simulation"])
def test_the_norm_rule_is_off_by_default_and_refuses_huge_finite_values_once_set(wall_clock):
    """One default in both modes (so an outlier cannot make them disagree): off."""
    ups = [_update(1, [1.5, 1.0]), _update(2, [1.0, 0.5]), _update(3, [3e38, 3e38])]
    server = _Server(_Course(wall_clock=wall_clock), {"w": torch.tensor([1.0, 1.0])})
    assert len(admit_updates(server, ups)) == 3 and "admission" not in server.course.monitor.extra_summary
    server.course.cfg = small_cfg(None, admission__norm_ratio=4.0)
    assert [u.client_id for u in admit_updates(server, ups)] == [1, 2]
    assert server.course.monitor.extra_summary["admission"] == {"update norm far above the round's others": 1}


def test_sample_counts_are_bounded_by_the_declaration_and_the_cap():
    server = _Server(_Course(admission__max_num_samples=50), {"w": torch.zeros(2)}, declared={1: 20, 2: 60})
    ups = [_update(1, [1.0, 0.0], n=20), _update(2, [0.0, 1.0], n=55), _update(3, [1.0, 1.0], n=2 ** 62)]
    ups.append(_update(1, [1.0, 0.0], n=21))
    kept = admit_updates(server, ups)
    assert [(u.client_id, u.content["num_samples"]) for u in kept] == [(1, 20)]
    assert server.course.monitor.extra_summary["admission"] == {
        "num_samples above admission.max_num_samples": 2, "num_samples above the declared count": 1}


def test_snapshot_restores_the_previous_model_and_finiteness_is_checked():
    agg = _Aggregator({"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(3)})
    snap = Snapshot(agg)
    agg.global_state["w"].fill_(float("nan"))  # an aggregator that wrote in place
    assert not finite_state(agg.global_state)
    snap.restore()
    assert torch.equal(agg.global_state["w"], torch.tensor([1.0, 2.0])) and finite_state(agg.global_state)


def test_a_snapshot_without_a_copy_puts_back_the_same_tensors_and_names_an_in_place_writer():
    """A folding round's snapshot keeps the global tensors themselves (no second model): an
    aggregator that replaces them gets them back; one that wrote them in place is named."""
    w, steps = torch.tensor([1.0, 2.0]), torch.tensor(3)
    agg = _Aggregator({"w": w, "steps": steps})
    snap = Snapshot(agg, copy=False)
    assert snap.global_state["w"] is w                       # no copy was made
    agg.global_state = {"w": torch.tensor([float("nan"), 0.0]), "steps": torch.tensor(4)}   # replaced
    snap.restore()
    assert agg.global_state["w"] is w and torch.equal(w, torch.tensor([1.0, 2.0]))
    assert agg.global_state["steps"] is steps and int(steps) == 3
    snap = Snapshot(agg, copy=False)
    agg.global_state["w"].fill_(float("nan"))                # written in place: nothing to put back
    with pytest.raises(RuntimeError, match="_Aggregator.aggregate wrote the global model's tensors in place"):
        snap.restore()


def test_an_update_standing_for_several_clients_is_bounded_by_their_declarations_together():
    """Secure aggregation hands the server one update for all its contributors: their declared
    counts (and the cap) add up; a larger claim is still refused."""
    server = _Server(_Course(admission__max_num_samples=50), {"w": torch.zeros(2)}, declared={1: 20, 2: 40, 3: 30})
    summed = _update(1, [1.0, 0.0], n=90)
    summed.contributors = [1, 2, 3]
    assert admit_updates(server, [summed]) == [summed]
    inflated = _update(1, [1.0, 0.0], n=91)
    inflated.contributors = [1, 2, 3]
    assert admit_updates(server, [inflated]) == []
    assert server.course.monitor.extra_summary["admission"] == {"num_samples above the declared count": 1}


def test_snapshot_puts_back_the_server_optimizers_moments():
    from fedcore.runtime.server_optimizer import ServerOptimizer
    agg = _Aggregator({"w": torch.tensor([1.0, 2.0])})
    agg.server_optimizer = opt = ServerOptimizer("adam", 0.1)
    opt.updates({"w": torch.tensor([0.5, -0.5])})
    before = {"m": opt.m["w"].clone(), "v": opt.v["w"].clone(), "t": opt.t}
    snap = Snapshot(agg)
    opt.updates({"w": torch.tensor([float("inf"), 1.0])})  # the rejected round's step
    snap.restore()
    assert opt.t == before["t"] and torch.equal(opt.m["w"], before["m"]) and torch.equal(opt.v["w"], before["v"])


DIVERGING = {"model.type": "mlp", "train.optimizer.lr": 1000.0, "federate.total_round_num": 8}


def test_a_diverging_simulation_stops_with_the_last_finite_model(tmp_path):
    cfg = small_cfg(tmp_path, federate__client_num=3, **{k.replace(".", "__"): v for k, v in DIVERGING.items()})
    with pytest.raises(CourseDiverged, match=r"course diverged in round (\d+): the aggregated model has "
                                             r"non-finite values \(likely cause: a learning rate"):
        Course(cfg).build().run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by"] == "diverged" and 1 <= summary["rounds"] < 8
    final = torch.load(tmp_path / "final_model.pt", weights_only=True)
    assert all(bool(torch.isfinite(t).all()) for t in final.values())


def test_a_diverging_run_exits_with_its_own_code_and_one_line(tmp_path):
    cfg = write_cfg(tmp_path / "c.yaml", DIVERGING)
    p = run_fedcore(["--cfg", cfg, f"outdir={tmp_path / 'out'}"], env=_env(), cwd=ROOT)
    assert p.returncode == EXIT_DIVERGED == 5
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("fedcore: course diverged in round ") and "Traceback" not in p.stderr


def test_json_outputs_are_strict(tmp_path):
    assert strict_json({"a": [1.0, float("nan")], "b": {"c": float("-inf")}, "d": 2}) == \
        {"a": [1.0, None], "b": {"c": None}, "d": 2}
    m = Monitor(tmp_path)
    m.record_round(1, 0.0, {"test_loss": float("inf"), "test_acc": float("nan")})
    m.finalize(0.0, None)

    def refuse(name):
        raise AssertionError(name)
    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert record["test_loss"] is None and record["test_acc"] is None
    json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)


def test_quiet_log_counts_everything_and_logs_each_kind_now_and_then(caplog):
    q = QuietLog(logging.getLogger("test.quiet"), every=3600)
    with caplog.at_level(logging.WARNING, logger="test.quiet"):
        for i in range(1000):
            q("bad frame", f"refused frame {i}")
        q("wrong token", "refused a token")
    assert q.counts == {"bad frame": 1000, "wrong token": 1}
    assert [r.getMessage() for r in caplog.records] == ["refused frame 0", "refused a token"]
    q.every = 0.0
    with caplog.at_level(logging.WARNING, logger="test.quiet"):
        q("bad frame", "refused frame 1000")
    assert caplog.records[-1].getMessage() == "refused frame 1000 (and 999 more like it)"
    assert math.isfinite(q._last["bad frame"])


def test_in_deployment_a_rejected_round_runs_again_until_max_rejected_rounds():
    from fedcore.runtime.admission import reject_round
    server = _Server(_Course(admission__max_rejected_rounds=3), {"w": torch.zeros(2)})
    assert reject_round(server, "the aggregated model has non-finite values") is True
    assert reject_round(server, "the aggregated model has non-finite values") is True
    assert reject_round(server, "the aggregated model has non-finite values") is False
    assert server.state(Outcome).diverged.startswith("course diverged in round 3: the aggregated model has non-finite")
    assert server.course.monitor.extra_summary["admission"] == {"rejected rounds": 3}


def test_a_deployed_client_skips_a_non_finite_model_and_never_sends_a_non_finite_update(caplog):
    from fedcore.comm.chunking import Reassembler, chunk_frames
    from fedcore.comm.client_inbound import ClientStream
    from fedcore.comm.grpc_client import GrpcClientComm
    from fedcore.comm.stream import parse_frame
    from fedcore.kernel.message import Message
    from fedcore.wire.serialization import encode_envelope

    class _Sched:
        calls = []

        def call_soon(self, action, priority=1):
            self.calls.append(action)
    cfg = small_cfg(None, federate__mode="distributed", distribute__role="client", distribute__insecure=True)
    comm = GrpcClientComm(cfg, _Sched())
    comm.client_id, comm.worker = 1, object()
    stream = ClientStream(Reassembler(2 ** 20, comm.chunk_size))
    stream.welcomed = True   # messages come after the server's welcome
    bad = {"model": {"w": torch.tensor([1.0, float("inf")])}}
    for raw in chunk_frames((encode_envelope("models", 0, [1], 2, 0.0, bad),), 1, 1024):
        comm._on_frame(parse_frame(raw, 4096), stream)
    assert _Sched.calls == [] and "not finite (content.model.w): skipped" in caplog.text
    comm.send(Message("updates", 1, (0,), 2, 0.0, {"model": {"w": torch.tensor([float("nan")])}, "num_samples": 3}))
    assert len(comm.outbox) == 0 and "the update is not finite" in caplog.text
    comm.send(Message("updates", 1, (0,), 2, 0.0, {"model": {"w": torch.tensor([1.0])}, "num_samples": 3}))
    assert len(comm.outbox) == 1


def test_metrics_gate_takes_one_finite_answer_per_evaluation_asked():
    from fedcore.comm.metrics_gate import MetricsGate
    from fedcore.kernel.message import Message
    refused = []
    gate = MetricsGate(lambda kind, line: refused.append(kind))
    gate.sent(Message("eval_request", 0, (1, 2), 4, 0.0, {}))
    gate.sent(Message("models", 0, (3,), 4, 0.0, {}))  # not a request for metrics

    def metrics(cid, round_, acc):
        return gate.admit(Message("metrics", cid, (0,), round_, 0.0, {"acc": acc}))
    assert metrics(1, 4, 0.5) and not metrics(1, 4, 1.0)       # a duplicate
    assert not metrics(3, 4, 1.0) and not metrics(2, 5, 1.0)   # never asked; another round
    assert not metrics(2, 4, float("nan")) and not metrics(2, 4, 0.7)  # its one answer was spent
    assert refused == ["unrequested or duplicate metrics"] * 3 + ["non-finite metrics",
                                                                  "unrequested or duplicate metrics"]


def test_medians_of_the_others_from_one_sort_equal_the_median_of_each_others_list():
    import random
    import statistics
    rng = random.Random(5)
    for n in list(range(2, 12)) + [57, 200]:
        for _ in range(20):
            values = [float(rng.choice([rng.random(), rng.randint(0, 3)])) for _ in range(n)]  # ties too
            expected = [statistics.median(values[:i] + values[i + 1:]) for i in range(n)]
            assert medians_of_others(values) == expected
    # a NaN distance counts as infinitely far: it is never a median below the real ones
    assert medians_of_others([1.0, float("nan"), 3.0]) == [float("inf"), 2.0, float("inf")]


def test_a_returning_clients_update_above_the_bound_is_scaled_to_it_not_refused():
    """Rounds 3 and 4 of a course admission first saw in round 3 (distances by hand)."""
    server = _Server(_Course(admission__norm_ratio=10.0), {"w": torch.tensor([1.0, 1.0])})
    # round 3: clients 1-4 sent every round so far; client 4's distance 30 > 10 x 2 = 20: refused
    ups = [_update(1, [2.0, 1.0]), _update(2, [1.0, 3.0]), _update(3, [4.0, 5.0]), _update(4, [19.0, 25.0])]
    assert [u.client_id for u in admit_updates(server, ups)] == [1, 2, 3]
    # round 4: clients 4 and 5 both at distance 40 (|(24, 32)|, |(0, 40)|), each 10 x the median
    # of (1, 2, 5, 40) = 35 allowed. Client 5 joins late (it missed round 3): scaled to 35.
    # Client 4 sent in round 3 (refused, but it was there): refused.
    server.round = 4
    ups = [_update(1, [2.0, 1.0]), _update(2, [1.0, 3.0]), _update(3, [4.0, 5.0]),
           _update(4, [25.0, 33.0]), _update(5, [1.0, 41.0])]
    kept = admit_updates(server, ups)
    assert [u.client_id for u in kept] == [1, 2, 3, 5]
    # client 5's w: (1, 1 + 35)
    assert kept[3].content["model"]["w"].tolist() == [1.0, 36.0]
    assert kept[3].content["num_samples"] == 10 and ups[4].content["model"]["w"].tolist() == [1.0, 41.0]
    assert server.course.monitor.extra_summary["admission"] == {
        "update norm far above the round's others": 2, "update of a returning client scaled to the bound": 1}


def test_a_client_that_missed_m_rounds_is_returning_when_it_comes_back_and_m_rounds_more():
    from fedcore.runtime.admission import Returning
    r = Returning(first_round=1)

    def sent(rnd, *ids):
        r.sent([ReceivedUpdate(c, {}, rnd, 0) for c in ids], rnd)

    sent(1, 1, 2)
    assert not r.returning(1, 2) and r.returning(3, 2)   # 3 never sent: it missed round 1
    sent(2, 1, 2, 3)                                    # 3 missed 1 round: returning in 2 and 3
    assert r.returning(3, 3) and not r.returning(2, 3)
    sent(3, 1, 2, 3)
    assert not r.returning(3, 4)
    for rnd in (4, 5):
        sent(rnd, 1, 3)
    sent(6, 1, 2, 3)              # 2 missed rounds 4 and 5: returning in 6 and the 2 rounds after
    assert [r.returning(2, k) for k in (7, 8)] == [True, True]
    sent(7, 1, 2, 3)
    sent(8, 1, 2, 3)
    assert not r.returning(2, 9)
    assert r.returning(1, 10) and not r.returning(1, 9)  # 1 misses round 9
    r.still_away(2, 9)            # an update of 2's scaled in round 9: returning 2 rounds more
    assert [r.returning(2, k) for k in (10, 11)] == [True, True]
    sent(9, 2)
    sent(10, 2)
    sent(11, 2)
    assert not r.returning(2, 12)


def test_scaled_update_moves_the_model_toward_the_global_one_and_scales_other_tensors():
    from fedcore.runtime.admission import scaled_update
    u = ReceivedUpdate(2, {"model": {"w": torch.tensor([3.0, 5.0]), "steps": torch.tensor(4)},
                           "control": {"c": torch.tensor([2.0, -2.0])}, "num_samples": 7}, 5, 1)
    out = scaled_update(u, {"w": torch.tensor([1.0, 1.0], dtype=torch.float64)}, 0.25)
    # w: 1 + 0.25 x (2, 4) = (1.5, 2); c: 0.25 x (2, -2); integers and counts untouched
    w = out.content["model"]["w"]
    assert w.tolist() == [1.5, 2.0] and w.dtype == torch.float32
    assert out.content["control"]["c"].tolist() == [0.5, -0.5] and out.content["model"]["steps"].item() == 4
    assert (out.client_id, out.round, out.staleness, out.content["num_samples"]) == (2, 5, 1, 7)
