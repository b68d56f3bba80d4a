"""A LoRA course deployed between real processes on loopback ends with its simulation's adapters
(to 1e-6) and sends the same bytes: the adapters' values at 4 bytes each plus the framing,
never the frozen base (each process builds the same base from the config and the seed)."""
import json

import pytest
import torch

from tests.conftest import skip_module_without

skip_module_without("llm", "transformers", "peft")

from fedcore.runtime.course import Course  # noqa: E402
from tests.deploy_helpers import FORK, text, wait_exit, write_cfg  # noqa: E402
from tests.test_llm import HIDDEN, RANK, TINY_LM, lm_cfg  # noqa: E402

pytestmark = pytest.mark.slow


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_deployed_lora_course_equals_its_simulation(tmp_path, procs):
    """With exact aggregation (the default): its SVD runs in the server process alone."""
    keys = dict(TINY_LM)
    cfg = write_cfg(tmp_path / "course.yaml", {**keys, "distribute.heartbeat_interval": 0.5})
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, 400) == 0, text(launcher)[-3000:]
    assert "client 2: course finished" in text(launcher)

    sim_dir = tmp_path / "simulated"
    Course(lm_cfg(sim_dir, **keys)).run()
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    assert deployed.keys() == simulated.keys() and all("lora_" in k for k in deployed)
    for entry in simulated:
        assert torch.allclose(deployed[entry], simulated[entry], rtol=0, atol=1e-6), entry
    adapter = RANK * HIDDEN + 3 * HIDDEN * RANK          # A: r x h, B: 3h x r on c_attn
    # framing per update: each tensor's name and at most ~40 bytes of tags, lengths, dtype and
    # shape; the envelope's header (type, ids, round, time, num_samples) well under 200 bytes
    framing = sum(len(k) + 40 for k in deployed) + 200
    dep, sim = _records(out / "metrics.jsonl"), _records(sim_dir / "metrics.jsonl")
    assert [r["round"] for r in dep] == [r["round"] for r in sim] == [1, 2]
    for d, s in zip(dep, sim):
        assert d["bytes_up"] == s["bytes_up"] and d["bytes_down"] == s["bytes_down"]
        assert 2 * 4 * adapter < d["bytes_up"] < 2 * (4 * adapter + framing)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainable_params"] == adapter < summary["total_params"]
