"""`--method fedex`: one course in which clients explore candidates drawn from the space.

Where the other methods run one course per configuration, FedEx (Khodak et
al., NeurIPS 2021; `fedcore.algorithms.fedex`) runs a single course whose
clients draw client-side values from a distribution the server sharpens
round by round. The space's keys must be ones FedEx can set per client
(learning rate, momentum, weight decay, local steps or epochs, batch size).
The study's one trial reports the course's objective; its params are the
candidate the final distribution holds most likely.
"""
from __future__ import annotations

import json

import numpy as np

from fedcore.kernel import registry
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.files import write_atomic
from fedcore.tune.study import Study

__all__ = ["fedex_search", "DEFAULT_ARMS"]

DEFAULT_ARMS = 9


def candidates_from_space(study: Study, arms: int | None) -> list[dict]:
    """The space's grid when it has at most `arms` points (default 9), else `arms` seeded draws."""
    local_keys = registry.components.get("fedex_local_keys")
    for key in study.space.keys:
        if key not in local_keys:
            raise ConfigError(f"--method fedex: '{key}' is not a client-side key FedEx can set per "
                              f"client; the space may use {', '.join(local_keys)}")
    grid = study.space.grid()
    limit = arms if arms is not None else DEFAULT_ARMS
    if limit < 1:
        raise ConfigError("--arms: must be >= 1")
    if len(grid) <= limit:
        return grid
    rng = np.random.default_rng(study.seed)
    return [study.space.sample(rng) for _ in range(limit)]


def fedex_search(study: Study, budget: float, arms: int | None) -> None:
    candidates = candidates_from_space(study, arms)
    study.expect(1)
    [row] = study.evaluate([(0, {"fedex.candidates": candidates}, budget)])
    if row.status != "complete":
        return
    summary = json.loads((study.trial_dir(0) / "summary.json").read_text())
    theta = summary["fedex_theta"]
    best = candidates[int(np.argmax(theta))]
    row.extra = {"best_params": best, "fedex_theta": theta}
    write_atomic(study.outdir / "fedex.json", json.dumps(
        {"candidates": candidates, "theta": theta, "most_likely": best}, indent=2) + "\n")
