"""Search methods over whole courses: random, grid, successive halving, Hyperband, TPE.

Each proposes (trial, params, budget) evaluations to a `Study` and reads back
the rows. Successive halving and Hyperband continue the trials they promote
from their checkpoints; TPE is Optuna's sampler (and, optionally, its pruners
deciding after each budget step), not a re-implementation.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from fedcore.kernel.errors import ConfigError
from fedcore.tune.study import Study

__all__ = ["METHODS", "rung_budgets", "random_search", "grid_search", "successive_halving", "hyperband", "tpe"]

log = logging.getLogger("fedcore.tune")


def rung_budgets(max_budget: float, min_budget: float, eta: int, integral: bool) -> list[float]:
    """Budgets min_budget * eta^k up to max_budget (the last is max_budget itself)."""
    if not 0 < min_budget <= max_budget:
        raise ConfigError(f"--min-budget: must be in (0, --budget={max_budget}]")
    s = int(math.floor(math.log(max_budget / min_budget, eta) + 1e-9))
    budgets = [max_budget / eta ** (s - k) for k in range(s + 1)]
    if integral:
        budgets = sorted({max(1, int(round(b))) for b in budgets})
    return [float(b) for b in budgets]


def random_search(study: Study, trials: int, budget: float, **_: Any) -> None:
    """`trials` configurations drawn independently from the space (seeded), each at `budget`."""
    rng = np.random.default_rng(study.seed)
    draws = [study.space.sample(rng) for _ in range(trials)]
    study.expect(trials)
    study.evaluate([(i, p, budget) for i, p in enumerate(draws)])


def grid_search(study: Study, trials: int | None, budget: float, **_: Any) -> None:
    """Every grid point of the space at `budget` (the first `trials` of them, if given)."""
    points = study.space.grid()
    if trials is not None and trials < len(points):
        log.warning("grid: %d points, --trials %d runs only the first ones", len(points), trials)
        points = points[:trials]
    study.expect(len(points))
    study.evaluate([(i, p, budget) for i, p in enumerate(points)])


def _check_resumable(study: Study, method: str) -> None:
    if study.async_course:
        raise ConfigError(f"--method {method}: promoted trials continue from checkpoints, which an "
                          "asynchronous course cannot resume; use --method random, grid or tpe")


def _halving(study: Study, configs: list[tuple[int, dict]], budgets: list[float], eta: int) -> None:
    """Evaluate all `configs` at budgets[0]; promote the best 1/eta to the next budget, which
    continues their courses from their checkpoints; repeat up to the last budget."""
    alive = configs
    for k, b in enumerate(budgets):
        rows = study.evaluate([(t, p, b) for t, p in alive], continue_runs=True)
        if k == len(budgets) - 1:
            break
        keep = max(1, len(alive) // eta)
        ranked = sorted(zip(rows, alive), key=lambda ra: _rank_key(study, ra[0]))
        alive = [a for _, a in ranked[:keep]]


def _halving_runs(configs: int, rungs: int, eta: int) -> int:
    """Evaluations `_halving` makes: every config on the first rung, 1/eta of them on each next."""
    total = 0
    for _ in range(rungs):
        total += configs
        configs = max(1, configs // eta)
    return total


def _rank_key(study: Study, row) -> tuple:
    """Sort key: complete before failed, better objective first, then trial number (ties)."""
    if row.status != "complete" or row.objective is None:
        return (1, 0.0, row.trial)
    value = -row.objective if study.objective.maximize else row.objective
    return (0, value, row.trial)


def successive_halving(study: Study, trials: int | None, budget: float, min_budget: float | None = None,
                       eta: int = 3, sample: str = "random", **_: Any) -> None:
    """Successive halving (Jamieson & Talwalkar; Li et al.): `trials` configurations (random, or
    the space's grid) at the smallest budget, the best 1/eta continued at eta times the budget,
    up to `budget`."""
    _check_resumable(study, "sha")
    min_budget = min_budget if min_budget is not None else budget / eta ** 2
    budgets = rung_budgets(budget, min_budget, eta, study.unit == "rounds")
    if sample == "grid":
        configs = study.space.grid()[:trials]
    elif trials is None:
        raise ConfigError("--trials: --method sha needs a number of trials (or --sample grid)")
    else:
        rng = np.random.default_rng(study.seed)
        configs = [study.space.sample(rng) for _ in range(trials)]
    study.expect(_halving_runs(len(configs), len(budgets), eta))
    _halving(study, list(enumerate(configs)), budgets, eta)


def hyperband(study: Study, trials: int | None, budget: float, min_budget: float | None = None,
              eta: int = 3, **_: Any) -> None:
    """Hyperband (Li et al., 2018): successive halving brackets from aggressive (many trials,
    small first budget) to none (few trials at the full budget)."""
    _check_resumable(study, "hyperband")
    min_budget = min_budget if min_budget is not None else budget / eta ** 2
    s_max = int(math.floor(math.log(budget / min_budget, eta) + 1e-9))
    rng = np.random.default_rng(study.seed)
    brackets = []
    for s in range(s_max, -1, -1):
        n = int(math.ceil((s_max + 1) / (s + 1) * eta ** s))
        brackets.append((n, rung_budgets(budget, budget / eta ** s, eta, study.unit == "rounds")))
    study.expect(sum(_halving_runs(n, len(budgets), eta) for n, budgets in brackets))
    next_trial = 0
    for n, budgets in brackets:
        configs = [(next_trial + i, study.space.sample(rng)) for i in range(n)]
        next_trial += n
        _halving(study, configs, budgets, eta)


def tpe(study: Study, trials: int, budget: float, pruner: str = "none",
        min_budget: float | None = None, eta: int = 3, **_: Any) -> None:
    """Optuna's TPE sampler proposes each configuration from the finished ones; with a pruner
    (median, sha, hyperband) a trial reports after each budget step and Optuna may stop it."""
    optuna = _optuna()
    storage = f"sqlite:///{(study.outdir / 'optuna.db').resolve()}"
    direction = "maximize" if study.objective.maximize else "minimize"
    steps = [budget]
    if pruner != "none":
        _check_resumable(study, f"tpe --pruner {pruner}")
        min_budget = min_budget if min_budget is not None else budget / eta ** 2
        steps = rung_budgets(budget, min_budget, eta, study.unit == "rounds")
    ostudy = optuna.create_study(study_name="fedcore", storage=storage, direction=direction,
                                 sampler=optuna.samplers.TPESampler(seed=study.seed),
                                 pruner=_pruner(optuna, pruner, steps, eta), load_if_exists=True)
    states = optuna.trial.TrialState
    for t in ostudy.get_trials(deepcopy=False, states=(states.RUNNING,)):
        ostudy.tell(t.number, state=states.FAIL)   # interrupted by an earlier stop: ask anew
    finished = len(ostudy.get_trials(deepcopy=False, states=(states.COMPLETE, states.PRUNED)))
    study.expect(max(0, trials - finished) * len(steps))   # with a pruner: at most that many
    while True:
        done = len(ostudy.get_trials(deepcopy=False, states=(states.COMPLETE, states.PRUNED)))
        if done >= trials:
            return
        batch = [ostudy.ask() for _ in range(min(study.parallel, trials - done))]
        alive = [(t, study.space.suggest(t)) for t in batch]
        last: dict[int, Any] = {}
        for k, step in enumerate(steps):
            rows = study.evaluate([(t.number, p, step) for t, p in alive], continue_runs=len(steps) > 1)
            still = []
            for (t, p), row in zip(alive, rows):
                last[t.number] = row
                if row.status != "complete":
                    ostudy.tell(t, state=states.FAIL)
                    continue
                if len(steps) > 1:
                    t.report(row.objective, int(step) if study.unit == "rounds" else k)
                    if k < len(steps) - 1 and t.should_prune():
                        ostudy.tell(t, state=states.PRUNED)
                        continue
                if k == len(steps) - 1:
                    ostudy.tell(t, row.objective)
                else:
                    still.append((t, p))
            alive = still
            if not alive:
                break


def _pruner(optuna, name: str, steps: list[float], eta: int):
    first = int(steps[0])
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    if name == "sha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=first, reduction_factor=eta)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=first, max_resource=int(steps[-1]),
                                              reduction_factor=eta)
    raise ConfigError(f"--pruner: '{name}' is not one of none, median, sha, hyperband")


def _optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError("--method tpe needs Optuna: pip install 'fedcore[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


METHODS = {"random": random_search, "grid": grid_search, "sha": successive_halving,
           "hyperband": hyperband, "tpe": tpe}
