"""Adaptive clipping (Andrew et al. 2021): hand-computed steps of the geometric update, the
noise split, the accounting unchanged, and the refusals."""
import json
import math

import pytest
import torch

from fedcore.algorithms.dp_adaptive_clip import AdaptiveClip, update_share
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.course import Course
from tests.conftest import small_cfg

ADAPTIVE = dict(privacy__dp__mode="central", privacy__dp__clip_each_step=False,
                privacy__dp__adaptive_clip__target_quantile=0.5, privacy__dp__adaptive_clip__lr=0.2)


def _deltas(*vectors):
    return [{"w": torch.tensor(v, dtype=torch.float64)} for v in vectors]


def test_two_noiseless_steps_by_hand():
    cfg = small_cfg(federate__client_num=3, privacy__dp__noise_multiplier=0.0, privacy__dp__clip_norm=1.0,
                    privacy__dp__adaptive_clip__count_stddev=0.0, **ADAPTIVE)
    clip = AdaptiveClip(cfg, lambda r: None)
    # norms 0.5, 2, 3 against C = 1: one below; b~ = (1 - 3/2) / 3 + 1/2 = 1/3
    mean, m = clip.rule(_deltas([0.3, 0.4], [2.0, 0.0], [0.0, -3.0]), [1.0] * 3, [1, 2, 3], 1)
    assert mean["w"].tolist() == pytest.approx([(0.3 + 1.0) / 3, (0.4 - 1.0) / 3], rel=1e-15)
    assert m["dp_below_clip_estimate"] == pytest.approx(1 / 3) and m["dp_clipped"] == 2
    c1 = math.exp(-0.2 * (1 / 3 - 0.5))                       # = exp(1/30) ~ 1.0339
    assert m["dp_clip_norm"] == 1.0 and clip.clip == pytest.approx(c1, rel=1e-15)
    # second step at C = exp(1/30): norms 1.0 and 1.02 are below it, 3 is not -> b~ = 2/3
    mean, m = clip.rule(_deltas([1.0, 0.0], [0.0, 1.02], [3.0, 0.0]), [1.0] * 3, [1, 2, 3], 2)
    assert m["dp_below_clip_estimate"] == pytest.approx(2 / 3)
    assert clip.clip == pytest.approx(c1 * math.exp(-0.2 * (2 / 3 - 0.5)), rel=1e-15)
    assert mean["w"].tolist() == pytest.approx([(1.0 + c1) / 3, 1.02 / 3], rel=1e-15)


def test_the_noise_split_composes_back_to_z():
    assert update_share(1.0, 1.0) == pytest.approx(2 / math.sqrt(3))      # (1 - 1/4)^(-1/2)
    for z, sb in ((0.8, 5.0), (1.3, 0.7)):
        sd = update_share(z, sb)
        assert sd ** -2 + (2 * sb) ** -2 == pytest.approx(z ** -2, rel=1e-12)
    with pytest.raises(ValueError):
        update_share(2.0, 1.0)       # 2 sigma_b must exceed z


def test_the_noises_are_the_round_sources_draws_update_first():
    cfg = small_cfg(federate__client_num=2, privacy__dp__noise_multiplier=1.0, privacy__dp__clip_norm=2.0,
                    privacy__dp__adaptive_clip__count_stddev=1.0, **ADAPTIVE)
    clip = AdaptiveClip(cfg, lambda r: torch.Generator().manual_seed(40 + r))
    mean, m = clip.rule(_deltas([1.0, 0.0, 0.0], [0.0, 4.0, 0.0]), [1.0, 1.0], [1, 2], 3)
    g = torch.Generator().manual_seed(43)
    z = torch.randn(3, generator=g, dtype=torch.float64)
    zb = torch.randn(1, generator=g, dtype=torch.float64).item()
    sd = 2 / math.sqrt(3)
    expected = (torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64) + sd * 2.0 * z) / 2
    assert mean["w"].tolist() == pytest.approx(expected.tolist(), rel=1e-12)
    estimate = (1 - 1.0 + zb) / 2 + 0.5
    assert m["dp_below_clip_estimate"] == pytest.approx(estimate, rel=1e-12)
    assert clip.clip == pytest.approx(2.0 * math.exp(-0.2 * (estimate - 0.5)), rel=1e-12)


def test_a_course_adapts_the_norm_and_spends_the_same_epsilon(tmp_path):
    common = dict(federate__sample_client_num=3, federate__total_round_num=3, eval__clients=False,
                  privacy__dp__noise_multiplier=1.0, privacy__dp__clip_norm=5.0)
    Course(small_cfg(tmp_path / "a", privacy__dp__adaptive_clip__count_stddev=1.0, **ADAPTIVE, **common)).run()
    Course(small_cfg(tmp_path / "f", privacy__dp__mode="central", privacy__dp__clip_each_step=False, **common)).run()
    rows = {d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "af"}
    norms = [r["dp_clip_norm"] for r in rows["a"]]
    assert norms[0] == 5.0 and len(set(norms)) == 3
    assert [r["dp_epsilon"] for r in rows["a"]] == [r["dp_epsilon"] for r in rows["f"]]


@pytest.mark.parametrize("overrides, match", [
    (dict(privacy__dp__clip_each_step=True), "privacy.dp.clip_each_step: adaptive clipping"),
    (dict(privacy__dp__adaptive_clip__count_stddev=0.4), "privacy.dp.adaptive_clip.count_stddev: noise multiplier 1 cannot"),
    (dict(privacy__dp__mode="local"), "privacy.dp.adaptive_clip.target_quantile: adaptive clipping is"),
    (dict(privacy__dp__adaptive_clip__target_quantile=1.5), "privacy.dp.adaptive_clip.target_quantile"),
])
def test_adaptive_clipping_refuses_what_it_cannot_do(overrides, match):
    with pytest.raises(ConfigError, match=match):
        small_cfg(**{**ADAPTIVE, "privacy__dp__noise_multiplier": 1.0, **overrides})
