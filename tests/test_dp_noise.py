"""Where DP noise comes from: seeded (reproducible) in simulation, the OS in deployment."""
import math

import pytest
import torch

from fedcore.algorithms.dp_noise import os_standard_normal, resolved_noise_source
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import small_cfg
from tests.deploy_helpers import ROOT, _env, write_cfg, run_fedcore


def test_os_draws_are_standard_normal_and_fresh():
    n = 200_001
    z = os_standard_normal(n)
    assert z.dtype == torch.float64 and z.numel() == n
    assert z.mean().item() == pytest.approx(0.0, abs=0.01)
    assert z.std().item() == pytest.approx(1.0, rel=0.01)
    for x in (-2.0, -1.0, 0.0, 0.5, 1.5):   # the empirical CDF against Phi(x) = (1 + erf(x/sqrt2))/2
        assert (z < x).double().mean().item() == pytest.approx(0.5 * (1 + math.erf(x / math.sqrt(2))),
                                                               abs=0.005)
    half = n // 2   # the cosine and sine halves of the Box–Muller pairs are uncorrelated
    assert torch.corrcoef(torch.stack([z[:half], z[half:2 * half]]))[0, 1].abs().item() < 0.01
    assert z.abs().max().item() <= math.sqrt(-2 * math.log(2.0 ** -53))   # the radius bound
    assert not torch.equal(os_standard_normal(8), os_standard_normal(8))


def test_auto_is_seeded_in_simulation_and_os_in_deployment():
    local = dict(privacy__dp__mode="local")
    assert resolved_noise_source(small_cfg(None, **local)) == "seeded"
    assert resolved_noise_source(small_cfg(None, federate__mode="distributed", **local)) == "os"
    assert resolved_noise_source(small_cfg(None, privacy__dp__noise_source="os", **local)) == "os"


def test_seeded_noise_is_refused_in_deployment_unless_the_diagnostic_switch_asks():
    deployed = dict(federate__mode="distributed", privacy__dp__noise_source="seeded")
    with pytest.raises(ConfigError, match="seeded noise in a deployment can be regenerated"):
        small_cfg(None, privacy__dp__mode="local", **deployed)
    with pytest.raises(ConfigError, match="seeded noise in a deployment"):
        small_cfg(None, privacy__dp__mode="central", **deployed)
    cfg = small_cfg(None, privacy__dp__mode="local", privacy__dp__seeded_noise_in_deployment=True, **deployed)
    assert resolved_noise_source(cfg) == "seeded"
    small_cfg(None, **deployed)   # no DP: nothing to refuse


def test_the_refusal_is_one_line_and_exit_2(tmp_path):
    cfg = write_cfg(tmp_path / "course.yaml")
    args = ["--cfg", cfg, "distribute.role=server", "distribute.insecure=true",
            "privacy.dp.mode=local", "privacy.dp.noise_source=seeded", f"outdir={tmp_path}"]
    done = run_fedcore(args, env=_env(), cwd=ROOT, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "privacy.dp.noise_source" in lines[0], done.stderr
    helped = run_fedcore(["--help-key", "privacy.dp.noise_source"], env=_env(), cwd=ROOT, timeout=120)
    assert helped.returncode == 0 and "auto" in helped.stdout and "os" in helped.stdout


def _final(tmp_path, **kw):
    course = Course(small_cfg(tmp_path, federate__total_round_num=2, eval__clients=False,
                              privacy__dp__noise_multiplier=1.0, **kw))
    summary = course.run()
    return course.server.aggregator.global_state, summary


@pytest.mark.parametrize("mode", [dict(privacy__dp__mode="local"),
                                  dict(privacy__dp__mode="central", federate__sample_client_num=3)],
                         ids=["local", "central"])
def test_seeded_simulation_is_bit_reproducible_and_os_noise_is_not(tmp_path, mode):
    a, summary = _final(tmp_path / "a", **mode)
    b, _ = _final(tmp_path / "b", **mode)
    assert summary["dp_noise_source"] == "seeded"
    assert all(torch.equal(a[k], b[k]) for k in a)
    c, os_summary = _final(tmp_path / "c", privacy__dp__noise_source="os", **mode)
    d, _ = _final(tmp_path / "d", privacy__dp__noise_source="os", **mode)
    assert os_summary["dp_noise_source"] == "os"
    assert not all(torch.equal(c[k], d[k]) for k in c)
