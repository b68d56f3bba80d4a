"""A client holding the config cannot strip a deployed DP-FTRL server's noise.

The attacker is the project's own `FtrlRelease` with one stage changed: its noise source is
the seeded generator a simulation would use (`noise_generator(seed, 0, t)`), and it is fed
only zero updates, so what it releases is exactly the noise a seeded course adds. The client
subtracts that, and the model it started from, from the published model. Against a
deployment made to use seeded noise (the diagnostic switch) what is left is the clipped
updates' mean (norm <= rounds x C); against the default (OS randomness) it is of the size
of two independent noises.
"""
import json
import math

import pytest
import torch

from fedcore.algorithms.combine import flatten, float_names
from fedcore.algorithms.dp_ftrl import FtrlRelease
from fedcore.algorithms.dp_noise import noise_generator
from tests.conftest import small_cfg
from tests.deploy_helpers import FORK, text, wait_exit, write_cfg
from tests.test_deploy_dp import _high

pytestmark = pytest.mark.slow

SIGMA, CLIP, SEED, ROUNDS = 5.0, 1.0, 0, 2
KEYS = {"seed": SEED, "federate.total_round_num": ROUNDS, "eval.clients": False,
        "privacy.dp.mode": "ftrl", "privacy.dp.noise_multiplier": SIGMA, "privacy.dp.clip_norm": CLIP}
SEEDED = {"privacy.dp.noise_source": "seeded", "privacy.dp.seeded_noise_in_deployment": True}


def _vec(model, names) -> torch.Tensor:
    return flatten({n: model[n].to(torch.float64) for n in names}, names)


def _attacker_noise(like: dict, names: list[str]) -> torch.Tensor:
    """The model's move a seeded course's noise makes over the rounds (zero updates in)."""
    cfg = small_cfg(federate__client_num=3, **{k.replace(".", "__"): v for k, v in KEYS.items()})
    release = FtrlRelease(cfg, 3, lambda t: noise_generator(SEED, 0, t))
    zero = {n: torch.zeros_like(like[n], dtype=torch.float64) for n in names}
    moved = torch.zeros(sum(like[n].numel() for n in names), dtype=torch.float64)
    for t in range(1, ROUNDS + 1):
        step, _ = release.rule([zero], [1.0], [0], t)
        moved += _vec(step, names)
    return moved, release


def test_a_client_cannot_regenerate_ftrl_noise(tmp_path, procs):
    launched = {}
    for name, keys in {"seeded": SEEDED, "os": {}}.items():
        cfg = write_cfg(tmp_path / f"{name}.yaml", {**KEYS, **keys, "plugins": ["tests.dp_spy_plugin"],
                                                     "dp_test.spy": True})
        out = tmp_path / name
        launched[name] = (out, procs.start(name, ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg),
                                                  f"outdir={out}"]))
    left = {}
    for name, (out, launcher) in launched.items():
        assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        published = torch.load(out / "final_model.pt", weights_only=True)
        initial = torch.load(out / "dp_spy" / "initial.pt", weights_only=True)
        names = float_names(initial)
        noise, release = _attacker_noise(initial, names)
        left[name] = ((_vec(published, names) - _vec(initial, names) - noise).norm().item(),
                      noise.numel(), release, summary)
    # seeded: what is left is the mean clipped updates of the rounds, each of norm <= C
    assert left["seeded"][0] <= ROUNDS * CLIP + 1e-3
    assert left["seeded"][3]["dp_noise_source"] == "seeded"
    norm_left, numel, release, summary = left["os"]
    assert summary["dp_noise_source"] == "os" and summary["dp_mode"] == "ftrl"
    # the prefix noise after 2 releases is one tree node (rounds 1-2) of std sigma C sens / m
    noise_norm = SIGMA * CLIP * release.sens * math.sqrt(numel) / release.m
    assert 0.5 * math.sqrt(2) * noise_norm < norm_left < _high(numel) * math.sqrt(2) * noise_norm + ROUNDS * CLIP
