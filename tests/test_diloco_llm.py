"""DiLoCo on a language model's LoRA adapters, the seed 002 contract unchanged: inner AdamW
with its state kept on each client, outer Nesterov (lr 0.7, momentum 0.9) on the mean of the
adapter deltas; the checks of test_diloco_e2e.py, run on a tiny decoder."""
import json

import pytest
import torch

from tests.conftest import skip_module_without

skip_module_without("llm", "transformers", "peft")

from tests.conftest import small_cfg  # noqa: E402
from tests.test_diloco_e2e import FAITHFUL, _walk_keys, check_two_nesterov_rounds, run_recorded  # noqa: E402
from tests.test_llm import TINY_LM  # noqa: E402

pytestmark = pytest.mark.slow
LM_DILOCO = {**{k.replace(".", "__"): v for k, v in TINY_LM.items()}, **FAITHFUL,
             "model__lora__aggregation": "separate"}


def test_outer_nesterov_step_on_the_adapters(tmp_path):
    course, sent, _ = run_recorded(small_cfg(tmp_path, **LM_DILOCO), tmp_path)
    g0 = check_two_nesterov_rounds(sent, tmp_path, not_fedavg_atol=1e-6)
    assert g0 and all(".lora_A." in k or ".lora_B." in k for k in g0)   # adapters only
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["outer_update_norm"] / records[0]["mean_delta_norm"] == pytest.approx(1.33, rel=1e-4)
    assert all("test_perplexity" in r for r in records)
    assert isinstance(course.trainer.optimizer, torch.optim.AdamW)
    for cid in (1, 2):
        assert course.store.load(cid)["inner_steps"] == 6


def test_inner_adamw_state_never_travels_and_bytes_equal_fedavg_on_adapters(tmp_path):
    course, sent, _ = run_recorded(small_cfg(tmp_path, **LM_DILOCO), tmp_path)
    for msg, _ in sent:
        assert not set(_walk_keys(msg.content)) & {"optimizer", "exp_avg", "exp_avg_sq", "step"}
    state = course.store.load(1)["optimizer"]["state"]
    assert state and all(v["exp_avg"].shape in {p.shape for p in course.trainer.params}
                         for v in state.values())
    fed, _, _ = run_recorded(small_cfg(tmp_path / "f", **dict(LM_DILOCO, algorithm__name="fedavg")),
                             tmp_path / "f")
    up = [r["bytes_up"] for r in course.monitor.records]
    assert up == [r["bytes_up"] for r in fed.monitor.records] and up[0] > 0
