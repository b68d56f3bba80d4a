"""SecureBoost deployed (the active party serving, each passive party a client process, gRPC on
loopback) grows the same trees as its simulation: the same handlers, the same Paillier sums
decrypted to the same fixed-point values, the same splits chosen in the same order. A malformed
or unasked message from a passive party is refused (on the wire, or by the handler naming it)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tests.conftest import skip_module_without
import torch
import yaml

skip_module_without("trees", "xgboost")
skip_module_without("data", "sklearn")
pytest.importorskip("phe", reason="SecureBoost needs python-paillier (extra: vertical)")
pytest.importorskip("cryptography", reason="vertical alignment (PSI) needs cryptography (extra: vertical)")

import fedcore  # noqa: E402
from fedcore.handlers import secureboost as sb  # noqa: E402
from fedcore.handlers.secureboost_checks import MESSAGE_CHECKS  # noqa: E402
from tests.deploy_helpers import ROOT, launch_course  # noqa: E402


def _cfg(tmp_path):
    """The shipped scenario, smaller: 2 trees of depth 2 and a 512-bit key (vertical.he.key_bits
    is configurable; what is compared does not depend on the key's size)."""
    tree = yaml.safe_load((ROOT / "scenarios" / "secureboost.yaml").read_text())
    tree["trees"].update({"num_trees": 2, "max_depth": 2})
    tree["vertical"]["he"]["key_bits"] = 512
    tree.update({"verbose": False, "distribute": {"heartbeat_interval": 0.5}})
    path = tmp_path / "secureboost.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.slow
def test_deployed_secureboost_equals_its_simulation(tmp_path, procs):
    cfg = _cfg(tmp_path)
    launch_course(procs, cfg, tmp_path / "dep", clients=2)
    sim = fedcore.run(str(cfg), outdir=str(tmp_path / "sim"))
    deployed = json.loads((tmp_path / "dep" / "final_model.json").read_text())
    simulated = json.loads((sim.outdir / "final_model.json").read_text())
    assert deployed == simulated and len(deployed["learner"]["gradient_booster"]["model"]["trees"]) == 2
    summary = json.loads((tmp_path / "dep" / "summary.json").read_text())
    assert summary["trees_mode"] == "secureboost" and summary["test_acc"] == sim.summary["test_acc"]
    records = [json.loads(line) for line in (tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    for dep, s in zip(records, sim.records):
        assert dep["train_loss"] == s["train_loss"] and dep["trees_count"] == s["trees_count"]
        assert dep["bytes_party_1"] > 0 and dep["virtual_time_party_2"] > 0


def _active(**sb_state):
    cfg = {"trees.max_bin": 16}
    test_rows = SimpleNamespace(x=torch.zeros(5, 2))
    return SimpleNamespace(course=SimpleNamespace(cfg=cfg), test_rows=test_rows,
                           sb=SimpleNamespace(**sb_state) if sb_state else None)


@pytest.mark.parametrize("msg_type, content, problem", [
    ("sb_bins", {"bins": torch.tensor([3, 40])}, "1..17"),
    ("sb_bins", {"bins": torch.tensor([3.0])}, "int64"),
    ("sb_histograms", {"c": [b"\x01" * 5]}, "128-byte"),
    ("sb_left", {"nodes": torch.tensor([1]), "left": torch.ones(1, 7, dtype=torch.bool)}, "1 x 4"),
    ("sb_reveal", {"thresholds": torch.tensor([[0, 0, 0, float("nan")]], dtype=torch.float64),
                   "test_left": torch.ones(1, 5, dtype=torch.bool)}, "finite"),
    ("sb_reveal", {"thresholds": torch.zeros(1, 4, dtype=torch.float64),
                   "test_left": torch.ones(2, 5, dtype=torch.bool)}, "1 x 5"),
])
def test_malformed_passive_messages_are_refused_on_the_wire(msg_type, content, problem):
    n = (1 << 511) + 1                     # a 512-bit modulus: n^2 takes 128 bytes
    active = _active(n=n, y=torch.zeros(4))
    got = MESSAGE_CHECKS[msg_type](content, active)
    assert got is not None and problem in got
    assert MESSAGE_CHECKS["sb_histograms"]({"c": [b"\x01" * 5]}, _active()) is not None   # before the key


def test_unasked_split_answers_stop_the_course_naming_the_party():
    state = SimpleNamespace(splits_pending={2}, asked={2: [1]})
    msg = SimpleNamespace(sender=2, content={"nodes": torch.tensor([3]), "left": torch.ones(1, 4, dtype=torch.bool)})
    with pytest.raises(sb.PartyMisbehaved, match="party 2 answered for nodes \\[3\\]"):
        sb.active_left(SimpleNamespace(sb=state), msg)
    msg.sender = 1
    with pytest.raises(sb.PartyMisbehaved, match="party 1"):
        sb.active_left(SimpleNamespace(sb=state), msg)
