"""Hyper-parameter search over federated courses (`python -m fedcore.tune`, or `tune(...)`).

    from fedcore.tune import tune
    result = tune("scenarios/tune_lr.yaml", "scenarios/spaces/tune_lr.yaml", method="sha",
                  trials=27, budget=27, outdir="runs/tune_lr")

Methods: random, grid, sha (successive halving), hyperband, tpe (Optuna), and
fedex (one course whose clients explore the space's candidates, Khodak et al.).
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcore.kernel.errors import ConfigError
from fedcore.tune.progress import StudyProgress
from fedcore.tune.space import Param, SearchSpace, load_space
from fedcore.tune.study import Objective, Study

__all__ = ["tune", "TuneResult", "SearchSpace", "Param", "load_space", "Objective", "Study", "METHOD_NAMES"]

METHOD_NAMES = ("random", "grid", "sha", "hyperband", "tpe", "fedex")


@dataclass
class TuneResult:
    """What a study found: the best trial's params and objective, where everything lies."""

    best_params: dict[str, Any] | None
    best_objective: float | None
    best_config: Path
    trials: list[dict[str, Any]]
    rounds_spent: int
    outdir: Path
    summary: dict[str, Any]


def tune(base: str | Path | dict, space: str | Path | dict | SearchSpace, method: str = "random",
         trials: int | None = None, budget: float | None = None, budget_unit: str = "rounds",
         metric: str = "val_acc", direction: str | None = None, seed: int = 0,
         outdir: str | Path | None = None, parallel: int = 1, min_budget: float | None = None,
         eta: int = 3, pruner: str = "none", arms: int | None = None,
         sample: str = "random", progress: bool = False) -> TuneResult:
    """Search `space` over courses of `base` (a YAML path or a dict of dotted keys) with `method`;
    `budget` is each trial's rounds (or virtual seconds), default the base's total_round_num;
    `sample="grid"` makes successive halving start from the space's grid instead of random draws.
    An outdir that already holds this study's trials resumes it. `progress`: a line per finished
    run on stderr (rewritten in place on a terminal)."""
    from fedcore.tune.report import write_outputs
    if method not in METHOD_NAMES:
        raise ConfigError(f"--method: '{method}' is not one of {', '.join(METHOD_NAMES)}")
    if direction not in (None, "maximize", "minimize"):
        raise ConfigError(f"--direction: '{direction}' is not maximize or minimize")
    if trials is not None and trials < 1:
        raise ConfigError("--trials: must be >= 1")
    if eta < 2:
        raise ConfigError("--eta: must be >= 2")
    space = space if isinstance(space, SearchSpace) else load_space(space)
    if outdir is None:
        outdir = Path("runs") / f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-tune-{method}"
    study = Study(base, space, outdir, Objective(metric, direction), budget_unit, seed, parallel)
    if progress:
        study.progress = StudyProgress(metric)
    try:
        _search(study, method, trials, budget, budget_unit, min_budget, eta, pruner, arms, sample)
    finally:
        if study.progress is not None:
            study.progress.close()
    summary = write_outputs(study, method)
    return TuneResult(summary["best_params"], summary["best_objective"], study.outdir / "best_config.yaml",
                      study.trials(), study.rounds_spent, study.outdir, summary)


def _search(study: Study, method: str, trials, budget, budget_unit: str, min_budget, eta: int,
            pruner: str, arms, sample: str) -> None:
    from fedcore.tune.methods import METHODS
    if budget is None:
        if budget_unit != "rounds":
            raise ConfigError("--budget: a virtual_time budget needs a value (seconds per trial)")
        budget = study.cap_rounds
    if budget <= 0 or (budget_unit == "rounds" and budget != int(budget)):
        raise ConfigError(f"--budget: must be a positive {'int' if budget_unit == 'rounds' else 'number'}")
    if method == "fedex":
        from fedcore.tune.fedex_method import fedex_search
        fedex_search(study, budget, arms)
    else:
        if sample not in ("random", "grid"):
            raise ConfigError(f"--sample: '{sample}' is not random or grid")
        if trials is None and method not in ("grid", "hyperband") and not (method == "sha" and sample == "grid"):
            raise ConfigError(f"--trials: --method {method} needs a number of trials")
        METHODS[method](study, trials=trials, budget=float(budget), min_budget=min_budget, eta=eta,
                        pruner=pruner, sample=sample)
