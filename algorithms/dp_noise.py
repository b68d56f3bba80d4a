"""Where DP noise comes from: the course seed in simulation, the operating system in deployment.

Seeded noise (`noise_generator(seed, party, round)`) makes a simulation bit-reproducible,
but anyone holding the config can regenerate it and subtract it: the server strips every
client's local noise, any client strips the server's central noise. So a deployed party
draws each release's noise from the OS's cryptographic randomness (`os.urandom`), fresh
every time, and refuses seeded noise unless a diagnostic switch explicitly asks for it.

`os` Gaussians: Box–Muller over pairs of uniforms with 53 random bits each (the
precision of a double), u1 = (k1 + 1) / 2^53 in (0, 1], u2 = k2 / 2^53 in [0, 1).
The radius sqrt(-2 ln u1) is at most sqrt(106 ln 2) ~ 8.57, so draws beyond 8.57 standard
deviations (probability ~1e-17) never occur. Like every textbook floating-point Gaussian,
the draws are not exactly the real-valued distribution the accountant assumes (the
floating-point attacks of Mironov, CCS 2012, apply to such samplers too).
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from fedcore.kernel.config import declare, validator
from fedcore.kernel.errors import ConfigError

__all__ = ["OS_NOISE", "deployed", "noise_generator", "noise_source", "resolved_noise_source",
           "os_standard_normal", "standard_normal"]

declare("privacy.dp.noise_source", str, "auto", "where DP noise comes from: seeded (from the "
        "course seed: reproducible, and removable by anyone holding the config), os (the "
        "operating system's cryptographic randomness, fresh for each release) or auto (seeded "
        "in simulation, os in deployment)", choices=("auto", "seeded", "os"))
declare("privacy.dp.seeded_noise_in_deployment", bool, False, "diagnostics only: let a deployed "
        "process use privacy.dp.noise_source=seeded (to compare a deployment with its simulation); "
        "its noise gives no privacy, since anyone holding the config can remove it")

_SCALE = 2.0 ** -53


class _OsNoise:
    """Marks noise drawn from the OS (no state: every draw is fresh)."""

    def __repr__(self) -> str:
        return "OS_NOISE"


OS_NOISE = _OsNoise()


def deployed(cfg) -> bool:
    """True in a process of a deployment (gRPC between processes), False in a simulation."""
    return cfg["federate.mode"] == "distributed" or cfg.get("distribute.role") is not None


def resolved_noise_source(cfg) -> str:
    """`seeded` or `os`: what `auto` means for this process."""
    source = cfg["privacy.dp.noise_source"]
    if source == "auto":
        return "os" if deployed(cfg) else "seeded"
    return source


@validator
def _check_noise_source(cfg) -> None:
    if cfg["privacy.dp.mode"] == "none" or not deployed(cfg):
        return
    if resolved_noise_source(cfg) == "seeded" and not cfg["privacy.dp.seeded_noise_in_deployment"]:
        raise ConfigError("privacy.dp.noise_source: seeded noise in a deployment can be regenerated "
                          "and removed by anyone holding the config; use auto or os")


def noise_generator(seed: int, party: int, round_: int) -> torch.Generator:
    """The seeded source of one client's (or, party 0, the server's) noise in one round."""
    return torch.Generator().manual_seed((seed * 1_000_003 + party) * 100_003 + round_ + 7)


def noise_source(cfg, party: int, round_: int):
    """What one release's noise is drawn from: a seeded generator, or `OS_NOISE`."""
    if resolved_noise_source(cfg) == "os":
        return OS_NOISE
    return noise_generator(cfg["seed"], party, round_)


def os_standard_normal(numel: int) -> torch.Tensor:
    """`numel` independent N(0, 1) draws (float64) from `os.urandom`, by Box–Muller."""
    pairs = (numel + 1) // 2
    bits = np.frombuffer(os.urandom(16 * pairs), dtype=np.uint64) >> np.uint64(11)
    u1 = (bits[:pairs].astype(np.float64) + 1.0) * _SCALE
    u2 = bits[pairs:].astype(np.float64) * _SCALE
    radius = np.sqrt(-2.0 * np.log(u1))
    angle = 2.0 * math.pi * u2
    z = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:numel]
    return torch.from_numpy(z)


def standard_normal(numel: int, source) -> torch.Tensor:
    """N(0, 1) draws (float64) from `source`: a torch.Generator or `OS_NOISE`."""
    if source is OS_NOISE:
        return os_standard_normal(numel)
    return torch.randn(numel, generator=source, dtype=torch.float64)

