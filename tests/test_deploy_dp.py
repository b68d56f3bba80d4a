"""DP noise in a deployment cannot be regenerated from the config by the party it hides from.

The attacker holds the course config (the seed included) and regenerates the noise a
seeded course would add, with the project's own `noise_generator`, then subtracts it:
- a curious server (the project's server with its update handler saving what it
  receives: tests/dp_spy_plugin.py) against each client's local noise;
- a client against the server's central noise on the published model.
Against a deployment that was made to use seeded noise (the diagnostic switch) both strip
the noise down to the clipped update; against the default (OS randomness) what is left is
of the noise's magnitude. Two deployed runs with one seed add different noise.
"""
import json
import math

import pytest
import torch

from fedcore.algorithms.combine import flatten, float_names
from fedcore.algorithms.dp import gaussian_noise
from fedcore.algorithms.dp_noise import noise_generator
from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.deploy_helpers import FORK, text, wait_exit, write_cfg

pytestmark = pytest.mark.slow

SIGMA, CLIP, SEED = 5.0, 1.0, 0
SEEDED = {"privacy.dp.noise_source": "seeded", "privacy.dp.seeded_noise_in_deployment": True}


def _deploy(tmp_path, procs, runs: dict[str, dict]) -> dict:
    """Launch one deployed course (server + 3 clients on loopback) per entry of `runs`, all at
    once; {name: (outdir, summary)} once all have finished."""
    launched = {}
    for name, keys in runs.items():
        cfg = write_cfg(tmp_path / f"{name}.yaml", {
            "seed": SEED, "federate.total_round_num": 1, "eval.clients": False,
            "privacy.dp.noise_multiplier": SIGMA, "privacy.dp.clip_norm": CLIP,
            "plugins": ["tests.dp_spy_plugin"], "dp_test.spy": True, **keys})
        out = tmp_path / name
        launched[name] = (out, procs.start(name, ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg),
                                                  f"outdir={out}"]))
    for out, launcher in launched.values():
        assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    return {name: (out, json.loads((out / "summary.json").read_text()))
            for name, (out, _) in launched.items()}


def _records(outdir):
    return [json.loads(line) for line in (outdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _vec(model, names) -> torch.Tensor:
    return flatten({n: model[n].to(torch.float64) for n in names}, names)


def _spied(out, client):
    kept = torch.load(out / "dp_spy" / f"r1_c{client}.pt", weights_only=True)
    names = float_names(kept["sent"])
    return _vec(kept["sent"], names), _vec(kept["received"], names)


def _high(numel: int) -> float:
    """How many times s sqrt(d) the norm of N(0, s^2 I_d) stays below but with probability
    e^-12: ||z||^2 / s^2 exceeds d + 2 sqrt(dx) + 2x with probability at most e^-x (Laurent and
    Massart, 2000), so a bound fails once in ~160,000 checks (with d = 27 a bound of 1.5 s sqrt(d)
    failed about once in 5,000)."""
    return math.sqrt(1 + 2 * math.sqrt(12 / numel) + 24 / numel)


def _stripped_local(out, client) -> torch.Tensor:
    """What the curious server keeps of client `client`'s round-1 update after subtracting the
    seeded noise it regenerates (clip + seeded noise were added in float64 by the client)."""
    sent, received = _spied(out, client)
    regenerated = gaussian_noise(sent.numel(), SIGMA * CLIP, noise_generator(SEED, client, 1))
    return received - sent - regenerated


def test_a_server_cannot_strip_local_noise_and_runs_differ(tmp_path, procs):
    local = {"privacy.dp.mode": "local"}
    runs = _deploy(tmp_path, procs, {"seeded": {**local, **SEEDED}, "os1": local, "os2": local})
    (seeded, seeded_summary), (first, summary), (second, _) = runs["seeded"], runs["os1"], runs["os2"]
    assert seeded_summary["dp_noise_source"] == "seeded" and summary["dp_noise_source"] == "os"
    numel = _spied(first, 1)[0].numel()
    noise_norm = SIGMA * CLIP * math.sqrt(numel)      # E||N(0, s^2 I_d)|| ~ s sqrt(d)
    high = _high(numel)
    for client in (1, 2, 3):
        # the attack works on seeded noise: what is left is the clipped update (norm <= C)
        assert _stripped_local(seeded, client).norm() <= CLIP * (1 + 1e-4)
        for out in (first, second):
            sent, received = _spied(out, client)
            assert 0.5 * noise_norm < (received - sent).norm() < high * noise_norm + CLIP
            # against OS noise what is left is two independent noises: ~ sqrt(2) times one
            left = _stripped_local(out, client).norm()
            assert 0.5 * math.sqrt(2) * noise_norm < left < high * math.sqrt(2) * noise_norm + CLIP
        # same seed, same data, same clipped update: the two runs' noises differ as two draws do
        gap = (_spied(first, client)[1] - _spied(second, client)[1]).norm()
        assert gap > 0.5 * math.sqrt(2) * noise_norm


def test_a_client_cannot_regenerate_central_noise(tmp_path, procs):
    k = 2   # of 3 clients: a Poisson sample with q = 2/3, the released mean divided by k
    central = {"privacy.dp.mode": "central", "federate.sample_client_num": k}
    results = {}
    for name, (out, summary) in _deploy(tmp_path, procs, {"seeded": {**central, **SEEDED},
                                                          "os": central}).items():
        published = torch.load(out / "final_model.pt", weights_only=True)
        # the model round 1 starts from (the Poisson sample may hold no client, q^0 (1-q)^3 = 1/27)
        initial = torch.load(out / "dp_spy" / "initial.pt", weights_only=True)
        names = float_names(initial)
        regenerated = gaussian_noise(sum(initial[n].numel() for n in names), SIGMA * CLIP,
                                     noise_generator(SEED, 0, 1))
        left = _vec(published, names) - _vec(initial, names) - regenerated / k
        results[name] = (left.norm().item(), regenerated.numel(), summary)
    # seeded: what is left is the mean of at most 3 clipped updates over k (norm <= 3C/k)
    assert results["seeded"][0] <= 3 * CLIP / k * (1 + 1e-4)
    left, numel, summary = results["os"]
    noise_norm = SIGMA * CLIP * math.sqrt(numel) / k
    assert 0.5 * math.sqrt(2) * noise_norm < left < _high(numel) * math.sqrt(2) * noise_norm + 3 * CLIP / k
    assert summary["dp_noise_source"] == "os"


def test_seeded_central_dp_with_an_empty_round_deploys_as_it_simulates(tmp_path, procs):
    """Poisson sampling in a deployment: with seeded noise and coins (the diagnostic switch) the
    deployed course, an empty round included, ends with the simulation's model."""
    keys = {"privacy.dp.mode": "central", "federate.sample_client_num": 1,
            "federate.total_round_num": 3, "eval.clients": False,
            "privacy.dp.noise_multiplier": 0.5, "privacy.dp.clip_norm": 0.5}
    for seed in range(20):   # q = 1/3: a seed whose 3 rounds include an empty sample
        sim_dir = tmp_path / f"sim{seed}"
        Course(small_cfg(sim_dir, seed=seed, federate__client_num=3,
                         **{k.replace(".", "__"): v for k, v in keys.items()})).run()
        sizes = [r["num_updates"] for r in _records(sim_dir)]
        if 0 in sizes:
            break
    assert 0 in sizes and len(set(sizes)) > 1, sizes
    cfg = write_cfg(tmp_path / "course.yaml", {**keys, **SEEDED, "seed": seed})
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), f"outdir={out}"])
    assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    assert [r["num_updates"] for r in _records(out)] == sizes
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    for entry in simulated:
        assert torch.allclose(deployed[entry], simulated[entry], rtol=0, atol=1e-6), entry
