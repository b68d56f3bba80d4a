"""Whole DiLoCo courses: the outer Nesterov step is what the server applies, optimizer state
never travels (by content and by bytes), outer SGD at lr 1 is FedAvg, and the scenarios
are complete and matched."""
import json
from pathlib import Path

import pytest
import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from fedcore.wire.serialization import encode_envelope
from tests.conftest import small_cfg

pytestmark = pytest.mark.slow
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"

FAITHFUL = dict(algorithm__name="diloco", federate__client_num=2, federate__total_round_num=2,
                train__local_steps=3, train__optimizer__type="adamw", train__optimizer__lr=0.05,
                train__preserve_optimizer_state=True, eval__clients=False)


def run_recorded(cfg, outdir):
    """Run a course and keep every (message, receiver) the communicator delivered."""
    course = Course(cfg, outdir).build()
    sent = []
    course.comm.filters.append(lambda msg, receiver: sent.append((msg, receiver)) or True)
    summary = course.run()
    return course, sent, summary


def by_round(sent, msg_type):
    out: dict[int, dict[int, dict]] = {}
    for msg, receiver in sent:
        if msg.msg_type == msg_type:
            out.setdefault(msg.round, {})[msg.sender if msg_type == "updates" else receiver] = msg.content
    return out


def mean_delta(updates, g):
    return {k: sum(u["model"][k] for u in updates.values()) / len(updates) - g[k] for k in g}


def check_two_nesterov_rounds(sent, outdir, not_fedavg_atol: float = 1e-4) -> dict:
    """The server's two outer steps are Nesterov's (lr 0.7, momentum 0.9) on the mean deltas,
    not FedAvg's; returns the first round's broadcast model."""
    models, updates = by_round(sent, "models"), by_round(sent, "updates")
    g0, g1 = models[1][1]["model"], models[2][1]["model"]
    d1 = mean_delta(updates[1], g0)
    mu, lr = 0.9, 0.7
    b1 = {k: -d1[k] for k in d1}
    for k in g0:
        expected = g0[k] - lr * (-d1[k] + mu * b1[k])                  # = g0 + 1.33 d1
        assert torch.allclose(g1[k], expected, atol=1e-6), k
        assert not torch.allclose(g1[k], g0[k] + d1[k], atol=not_fedavg_atol), k  # not FedAvg's step
    d2 = mean_delta(updates[2], g1)
    final = torch.load(outdir / "final_model.pt", weights_only=True)
    for k in g1:
        b2 = mu * b1[k] - d2[k]
        assert torch.allclose(final[k], g1[k] - lr * (-d2[k] + mu * b2), atol=1e-6), k
    return g0


def test_faithful_run_applies_the_nesterov_step_not_the_fedavg_step(tmp_path):
    course, sent, summary = run_recorded(small_cfg(tmp_path, **FAITHFUL), tmp_path)
    check_two_nesterov_rounds(sent, tmp_path)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["outer_update_norm"] / records[0]["mean_delta_norm"] == pytest.approx(1.33, rel=1e-4)
    assert summary["rounds"] == 2 and summary["final_test_acc"] is not None
    for cid in (1, 2):
        assert course.store.load(cid)["inner_steps"] == 6                # H per round, 2 rounds


def _walk_keys(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _walk_keys(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_keys(v)


def test_optimizer_and_scheduler_state_never_travel(tmp_path):
    cfg = small_cfg(tmp_path, train__scheduler__type="cosine", train__scheduler__total_steps=10,
                    **FAITHFUL)
    course, sent, _ = run_recorded(cfg, tmp_path)
    updates = by_round(sent, "updates")
    for msg, _ in sent:
        keys = set(_walk_keys(msg.content))
        assert not keys & {"optimizer", "scheduler", "state", "exp_avg", "exp_avg_sq", "step",
                           "inner_steps", "sampler", "last_epoch"}, msg.msg_type
    for cid, content in updates[2].items():
        assert set(content) == {"model", "num_samples"}
        state = course.store.load(cid)
        assert state["optimizer"]["state"] and state["scheduler"]["last_epoch"] == 6
        wire = b"".join(encode_envelope(m.msg_type, m.sender, (r,), m.round, m.timestamp, m.content)
                        for m, r in sent if m.sender == cid)
        for per_param in state["optimizer"]["state"].values():
            for name in ("exp_avg", "exp_avg_sq"):
                raw = per_param[name].contiguous().view(torch.uint8).numpy().tobytes()
                assert raw not in wire, name
    # the same bytes up as a FedAvg course on the same model and data
    fed = run_recorded(small_cfg(tmp_path / "fedavg", **dict(FAITHFUL, algorithm__name="fedavg")),
                       tmp_path / "fedavg")
    diloco_up = [r["bytes_up"] for r in course.monitor.records]
    assert diloco_up == [r["bytes_up"] for r in fed[0].monitor.records] and diloco_up[0] > 0


def test_outer_sgd_lr_one_course_equals_fedavg_course(tmp_path):
    keys = dict(FAITHFUL, federate__client_num=3, federate__total_round_num=3)
    dil = small_cfg(tmp_path / "d", algorithm__diloco__outer_optimizer="sgd",
                    algorithm__diloco__outer_learning_rate=1.0,
                    algorithm__diloco__aggregation_weighting="num_samples",
                    data__synthetic__samples_per_client=None, **keys)
    fed = small_cfg(tmp_path / "f", data__synthetic__samples_per_client=None,
                    **dict(keys, algorithm__name="fedavg"))
    Course(dil).run()
    Course(fed).run()
    a = torch.load(tmp_path / "d" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "f" / "final_model.pt", weights_only=True)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_scenarios_are_complete_and_diloco_matches_fedavg_work(tmp_path):
    d = load_config(SCENARIOS / "diloco_mlp.yaml", [f"outdir={tmp_path / 'd'}"])
    f = load_config(SCENARIOS / "fedavg_mlp_matched.yaml", [f"outdir={tmp_path / 'f'}"])
    assert d["algorithm.name"] == "diloco" and f["algorithm.name"] == "fedavg"
    assert d.section("train") == f.section("train")                 # same inner steps and optimizer
    for key in ("federate.client_num", "federate.total_round_num", "data.type", "model.type", "seed"):
        assert d[key] == f[key], key
    for cfg in (d, f, load_config(SCENARIOS / "diloco_char_lm.yaml", [f"outdir={tmp_path / 'c'}"])):
        course = Course(cfg).build()
        course.write_header()
        assert course.check().graph.number_of_nodes() > 0


def test_client_state_round_trips_through_the_disk_store(tmp_path):
    """Optimizer and scheduler state saved with torch.save and read back weights_only give
    the same course as the in-memory store."""
    keys = dict(FAITHFUL, train__scheduler__type="cosine", train__scheduler__warmup_steps=1,
                train__scheduler__total_steps=6)
    Course(small_cfg(tmp_path / "m", **keys)).run()
    Course(small_cfg(tmp_path / "d", state__store="disk", state__path=str(tmp_path / "s"), **keys)).run()
    a = torch.load(tmp_path / "m" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "d" / "final_model.pt", weights_only=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    saved = torch.load(tmp_path / "s" / "client_1.pt", weights_only=True)
    assert saved["scheduler"]["last_epoch"] == 6 and saved["inner_steps"] == 6
