"""The digits scenario end to end, shortened: FedAvg under Dirichlet(0.5) skew learns real data."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import skip_module_without

skip_module_without("data")   # imported by the courses that run, not at collection

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from fedcore.scenarios.models import build_model

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "digits_dirichlet.yaml"


@pytest.mark.slow
def test_digits_dirichlet_few_rounds_beats_chance(tmp_path):
    cfg = load_config(SCENARIO, [f"outdir={tmp_path}", "verbose=false", "federate.total_round_num=4",
                                 "eval.freq=4", "eval.clients=false"])
    assert cfg["data.type"] == "digits" and 20 <= cfg["federate.client_num"] <= 50
    assert cfg["data.partition"] == "dirichlet" and cfg["data.alpha"] == 0.5
    summary = Course(cfg).run()
    assert summary["rounds"] == 4
    assert summary["final_test_acc"] > 0.6  # chance is 0.1 with ten classes


def _leaf(path, users):
    import json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"users": list(users), "num_samples": [len(v[1]) for v in users.values()],
                                "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}))


@pytest.mark.slow
@pytest.mark.parametrize("dataset,model,over", [
    ("leaf_femnist", "convnet2", ["model.convnet2_hidden=16", "model.norm=batch"]),
    ("leaf_femnist", "lenet5", []),
    ("leaf_shakespeare", "char_lstm", ["model.lstm.hidden=8", "model.lstm.layers=1"]),
])
def test_leaf_courses_run_with_zoo_models(tmp_path, dataset, model, over):
    if dataset == "leaf_femnist":
        sample = [[(i % 28) / 28 for i in range(784)]]
        users = {f"w{u}": (sample * 6, [u, u + 1, u, u + 2, u, 61]) for u in range(3)}
    else:
        users = {f"p{u}": (["to be or not to be, that is"[: 10]] * 6, list("abcdef")) for u in range(3)}
    _leaf(tmp_path / "data" / "train" / "a.json", users)
    first_x, first_y = next(iter(users.values()))
    _leaf(tmp_path / "data" / "test" / "a.json", {"u0": (first_x[:2], first_y[:2])})
    cfg = load_config(None, [f"outdir={tmp_path / 'out'}", "verbose=false", f"data.type={dataset}",
                             f"data.root={tmp_path / 'data'}", "data.partition=natural",
                             "federate.client_num=3", "federate.total_round_num=2", f"model.type={model}",
                             "train.batch_size=4", *over])
    summary = Course(cfg).run()
    assert summary["rounds"] == 2 and 0.0 <= summary["final_test_acc"] <= 1.0
    state = torch.load(tmp_path / "out" / "final_model.pt", weights_only=True)
    shape, classes = ((1, 28, 28), 62) if dataset == "leaf_femnist" else ((10,), 80)
    assert set(state) == set(build_model(cfg, shape, classes).state_dict())
    if model == "convnet2":  # BatchNorm statistics travel and average like any other entry
        assert state["features.1.num_batches_tracked"].dtype == torch.long
        assert int(state["features.1.num_batches_tracked"]) > 0

