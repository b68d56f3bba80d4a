"""docs/extending.md: a user's dataset, partitioner, model and trainer plug in by name."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture
def on_path():
    sys.path.insert(0, str(DOCS / "examples"))
    yield
    sys.path.remove(str(DOCS / "examples"))


def guide_yaml() -> str:
    """The guide's YAML block, as a user would copy it."""
    return re.findall(r"```yaml\n(.*?)```", (DOCS / "extending.md").read_text(), re.S)[0]


def test_the_guides_config_runs_with_every_piece(tmp_path, on_path):
    (tmp_path / "mine.yaml").write_text(guide_yaml())
    cfg = load_config(tmp_path / "mine.yaml", [f"outdir={tmp_path / 'out'}", "verbose=false"])
    course = Course(cfg).build()
    assert type(course.trainer).__name__ == "SmoothTrainer"
    assert [type(m).__name__ for m in course.server.model] == ["Flatten", "Linear", "Tanh", "Linear"]
    # by_quadrant: each client's samples all lie in its own quadrant (k mod 4)
    for cid, data in course.data.clients.items():
        x = torch.cat([data.train.x, data.val.x, data.test.x])
        quadrant = ((x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()).unique().tolist()
        assert quadrant == [(cid - 1) % 4]
    summary = course.run()
    assert summary["rounds"] == cfg["federate.total_round_num"] and summary["final_test_acc"] > 0.5


def test_the_partitioner_covers_every_sample_once(on_path):
    from my_plugins import by_quadrant, rings
    cfg = load_config(None, extra={"plugins": ["my_plugins"], "data.rings.samples": 400})
    raw = rings(cfg)
    parts = by_quadrant(raw, 10, cfg)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(400))


def test_smoothing_off_is_fedavg_exactly(tmp_path, on_path):
    def final(name, **extra):
        cfg = load_config(None, extra={"plugins": ["my_plugins"], "seed": 0, "verbose": False,
                                       "data.type": "rings", "data.partition": "by_quadrant",
                                       "model.type": "tiny_mlp", "model.dtype": "float64",
                                       "federate.client_num": 8, "federate.total_round_num": 2,
                                       "outdir": str(tmp_path / name), **extra})
        Course(cfg).run()
        return torch.load(tmp_path / name / "final_model.pt", weights_only=True)
    smooth = final("smooth", **{"algorithm.name": "smooth_fedavg", "algorithm.smooth_fedavg.eps": 0.0})
    plain = final("plain", **{"algorithm.name": "fedavg"})
    assert all(torch.equal(smooth[k], plain[k]) for k in plain)
    assert not all(torch.equal(a, b) for a, b in zip(
        final("eps", **{"algorithm.name": "smooth_fedavg"}).values(), plain.values()))
