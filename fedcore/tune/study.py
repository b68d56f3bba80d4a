"""A study: trials of one base course over a search space, and the records they leave.

Every evaluation of a trial at a budget is one row of `trials.jsonl`, appended
as soon as it ends; a study started again in the same outdir reads those rows
and runs only what is missing, so an interrupted study resumes where it
stopped. A trial evaluated at a larger budget than before continues its course
from the checkpoint its last evaluation wrote (`resume_from`), in the same run
folder, so its records stay one continuous course.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedcore.kernel.config import Config, composed_keys
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.files import make_folder, open_append, write_atomic
from fedcore.tune.progress import StudyProgress
from fedcore.tune.runner import CourseRun, Job, run_jobs
from fedcore.tune.space import SearchSpace

__all__ = ["Objective", "Row", "Study", "BUDGET_UNITS"]

log = logging.getLogger("fedcore.tune")

BUDGET_UNITS = ("rounds", "virtual_time")


@dataclass(frozen=True)
class Objective:
    """A metric of the course's records, best over the rounds run so far."""

    metric: str = "val_acc"
    direction: str | None = None      # maximize / minimize; default from the metric's name

    @property
    def maximize(self) -> bool:
        if self.direction is not None:
            return self.direction == "maximize"
        return not self.metric.endswith("loss")

    def of(self, records: list[dict[str, Any]]) -> float | None:
        values = [r[self.metric] for r in records if isinstance(r.get(self.metric), (int, float))]
        if not values:
            return None
        return max(values) if self.maximize else min(values)

    def better(self, a: float | None, b: float | None) -> bool:
        """Is `a` strictly better than `b` (None is worst)?"""
        if a is None:
            return False
        return b is None or (a > b if self.maximize else a < b)


@dataclass
class Row:
    """One evaluation of one trial at one budget."""

    trial: int
    params: dict[str, Any]
    budget: float
    status: str                      # complete, diverged, failed
    objective: float | None = None
    rounds: int = 0                  # rounds this evaluation ran (a continuation counts only its own)
    last_round: int = 0
    virtual_time: float = 0.0
    wall_time: float = 0.0
    outdir: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        if not d["extra"]:
            del d["extra"]
        return d


class Study:
    """Runs evaluations of trials (cached in `trials.jsonl`) and writes the study's outputs."""

    def __init__(self, base: str | Path | dict, space: SearchSpace, outdir: str | Path,
                 objective: Objective = Objective(), budget_unit: str = "rounds", seed: int = 0,
                 parallel: int = 1):
        if budget_unit not in BUDGET_UNITS:
            raise ConfigError(f"--budget-unit: '{budget_unit}' is not one of {', '.join(BUDGET_UNITS)}")
        self.outdir = make_folder(outdir)
        self.space, self.objective, self.unit = space, objective, budget_unit
        self.seed, self.parallel = seed, max(1, int(parallel))
        self.base_tree = _base_tree(base)
        self.base = self.outdir / "base.yaml"     # what every trial's `--cfg` reads
        write_atomic(self.base, yaml.safe_dump(self.base_tree, sort_keys=False))
        self._check_base()
        if objective.metric.startswith("test_"):
            log.warning("objective %s: selecting a configuration on test data makes its test "
                        "score optimistic; use a val_* metric and report test_* once, at the end",
                        objective.metric)
        self.progress: StudyProgress | None = None   # shown by `python -m fedcore.tune`
        self.rows: list[Row] = []
        self._cache: dict[tuple[int, float], Row] = {}
        self._table = self.outdir / "trials.jsonl"
        for row in _read_rows(self._table):
            self._cache[(row.trial, row.budget)] = row
            self.rows.append(row)   # the study's outputs cover its earlier runs too
        self._table_open = False    # trials.jsonl made afresh (holding the rows read) on the first record

    # ------------------------------------------------------------ configs
    def _check_base(self) -> None:
        """Load the base with the space's first grid point: a bad base fails here, once."""
        from fedcore.kernel.config import load_config
        params = {p.key: p.grid_values()[0] for p in self.space.params}
        cfg = load_config(self.base, Job(self.base, {**params, **self._fixed()}, self.outdir).argv())
        self.cap_rounds = cfg["federate.total_round_num"]
        self.async_course = cfg["course"] == "async"

    def _fixed(self) -> dict[str, Any]:
        fixed: dict[str, Any] = {"verbose": False}
        if self.objective.metric.startswith("val_"):
            fixed["eval.val"] = True
        return fixed

    def trial_dir(self, trial: int) -> Path:
        return self.outdir / "trials" / f"{trial:04d}"

    def _budget_overrides(self, budget: float) -> dict[str, Any]:
        if self.unit == "rounds":
            return {"federate.total_round_num": int(budget)}
        return {"federate.time_limit": float(budget)}

    # ------------------------------------------------------------ evaluations
    def expect(self, runs: int) -> None:
        """A method announces `runs` more evaluations, for the progress display's total."""
        if self.progress is not None:
            self.progress.expect(runs)

    def _finished(self, row: Row, cached: bool = False) -> Row:
        if self.progress is not None:
            self.progress.finished(row, self.best(), cached)
        return row

    def evaluate(self, requests: list[tuple[int, dict[str, Any], float]],
                 continue_runs: bool = False) -> list[Row]:
        """Rows of trials at budgets: cached ones as recorded, the rest run (in parallel where
        the study allows). With `continue_runs`, a trial already run at a smaller budget
        continues from its checkpoint instead of starting over."""
        out: dict[int, Row] = {}
        jobs, pending = [], []
        for i, (trial, params, budget) in enumerate(requests):
            cached = self._cache.get((trial, float(budget)))
            if cached is not None and cached.status == "complete":
                if cached.params != params:
                    raise ConfigError(f"--outdir: {self.outdir} holds a study whose trial {trial} had "
                                      f"{cached.params}, not {params}; use a new --outdir")
                out[i] = self._finished(cached, cached=True)
                continue
            job, start = self._job(trial, params, float(budget), continue_runs)
            if job is None:  # nothing left to run: the course already reached its last round
                out[i] = self._finished(self._record(self._carry(start, float(budget))), cached=True)
                continue
            jobs.append(job)
            pending.append((i, trial, params, float(budget), start))
        for (i, trial, params, budget, start), run in zip(pending, run_jobs(jobs, self.parallel)):
            out[i] = self._finished(self._record(self._row(trial, params, budget, run, start)))
        return [out[i] for i in range(len(requests))]

    def _previous(self, trial: int, budget: float) -> Row | None:
        """The trial's latest complete evaluation at a smaller budget."""
        earlier = [r for r in self.rows if r.trial == trial and r.budget < budget and r.status == "complete"]
        return max(earlier, key=lambda r: r.budget, default=None)

    def _job(self, trial: int, params: dict, budget: float, continue_runs: bool):
        overrides = {**params, **self._budget_overrides(budget), **self._fixed()}
        start = self._previous(trial, budget) if continue_runs else None
        if continue_runs:
            # rounds: one checkpoint at the end of this budget; time: one per round (the last
            # is kept), since which round crosses the time budget is not known in advance
            overrides["checkpoint.every"] = int(budget) if self.unit == "rounds" else 1
        if start is not None:
            if self.unit == "virtual_time" and start.last_round >= self.cap_rounds:
                return None, start
            overrides["resume_from"] = str(Path(start.outdir) / "checkpoints" / f"round_{start.last_round}.pt")
        return Job(self.base, overrides, self.trial_dir(trial)), start

    def _row(self, trial: int, params: dict, budget: float, run: CourseRun, start: Row | None) -> Row:
        first = start.last_round if start is not None else 0
        if run.error is not None:
            return Row(trial, params, budget, "failed", outdir=str(run.outdir), error=run.error)
        last = run.records[-1] if run.records else {}
        value = self.objective.of(run.records)
        if run.diverged is not None:
            # its finite rounds count, and so does the round that diverged; never promoted
            ran = int(last.get("round", first)) + 1
            return Row(trial, params, budget, "diverged", value, ran - first, int(last.get("round", first)),
                       float(last.get("virtual_time", 0.0)), float(run.summary.get("wall_time", 0.0)),
                       str(run.outdir), error=run.diverged)
        if value is None:
            raise ConfigError(f"objective: metric '{self.objective.metric}' is in no record of "
                              f"{run.outdir}/metrics.jsonl; choose one of "
                              f"{', '.join(sorted(k for k in last if isinstance(last[k], float)))}")
        if self.unit == "virtual_time":
            self._keep_last_checkpoint(run.outdir, last.get("round", 0))
        return Row(trial, params, budget, "complete", value, int(last.get("round", 0)) - first,
                   int(last.get("round", 0)), float(last.get("virtual_time", 0.0)),
                   float(run.summary.get("wall_time", 0.0)), str(run.outdir))

    def _carry(self, start: Row, budget: float) -> Row:
        return Row(start.trial, start.params, budget, "complete", start.objective, 0, start.last_round,
                   start.virtual_time, 0.0, start.outdir)

    @staticmethod
    def _keep_last_checkpoint(outdir: Path, last_round: int) -> None:
        folder = Path(outdir) / "checkpoints"
        for f in folder.glob("round_*.pt") if folder.is_dir() else ():
            if f.name != f"round_{last_round}.pt":
                f.unlink()

    def _record(self, row: Row) -> Row:
        self.rows.append(row)
        self._cache[(row.trial, row.budget)] = row
        if not self._table_open:   # rewritten once, all or nothing: a link there is replaced, not followed
            write_atomic(self._table, "".join(json.dumps(r.as_dict()) + "\n" for r in self.rows))
            self._table_open = True
        else:
            with open_append(self._table) as f:
                f.write(json.dumps(row.as_dict()) + "\n")
        return row

    # ------------------------------------------------------------ results
    def best(self) -> Row | None:
        """The best complete evaluation at the largest budget any trial reached (a trial stopped
        early is not compared with the finished ones' full-budget scores)."""
        done = [r for r in self.rows if r.status == "complete"]
        if not done:
            return None
        top = max(r.budget for r in done)
        best = None
        for r in done:
            if r.budget == top and self.objective.better(r.objective, best.objective if best else None):
                best = r
        return best

    @property
    def rounds_spent(self) -> int:
        """Rounds run by this study's evaluations (continuations count only their own rounds)."""
        return sum(r.rounds for r in self._unique_rows())

    def _unique_rows(self) -> list[Row]:
        seen: dict[tuple[int, float], Row] = {}
        for r in self.rows:
            seen[(r.trial, r.budget)] = r
        return list(seen.values())

    def trials(self) -> list[dict[str, Any]]:
        """One entry per trial: its params, its last evaluation's objective and budget, the rounds
        all its evaluations ran, and its status (complete, stopped early, diverged, failed)."""
        top = max((r.budget for r in self.rows if r.status == "complete"), default=0.0)
        by_trial: dict[int, list[Row]] = {}
        for r in self._unique_rows():
            by_trial.setdefault(r.trial, []).append(r)
        out = []
        for trial in sorted(by_trial):
            rows = sorted(by_trial[trial], key=lambda r: r.budget)
            last = rows[-1]
            status = last.status if last.status in ("failed", "diverged") or last.budget >= top else "stopped"
            out.append({"trial": trial, "params": last.extra.get("best_params", last.params),
                        "objective": last.objective, "budget": last.budget,
                        "rounds": sum(r.rounds for r in rows), "status": status, "outdir": last.outdir})
        return out

    def best_config(self) -> dict:
        """The base config with the best trial's values (and its budget), ready to run."""
        best = self.best()
        tree = json.loads(json.dumps(self.base_tree))
        tree.pop("outdir", None)
        if best is None:
            return tree
        values = {k: v for k, v in self._fixed().items() if k != "verbose"}
        values.update(best.extra.get("best_params", best.params))
        if self.unit == "rounds":
            values["federate.total_round_num"] = int(best.budget)
        else:
            values["federate.time_limit"] = float(best.budget)
        for key, value in values.items():
            _set_dotted(tree, key, value)
        return tree


def _base_tree(base: str | Path | dict) -> dict:
    """The base config as one nested tree: a YAML file is composed as `fedcore.run` reads it
    (its `defaults:` merged in, since base.yaml is written elsewhere; an empty file refused)."""
    if isinstance(base, dict):
        tree: dict = {}
        for key, value in base.items():
            _set_dotted(tree, key, value)
        return tree
    return Config(composed_keys(base)).as_tree()


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set `a.b.c` in a nested tree, replacing a dotted spelling of the same key if present."""
    tree.pop(key, None)
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        rest = ".".join(parts[i + 1:])
        if isinstance(node.get(part), dict):
            node[part].pop(rest, None)
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key '{key}': '{part}' is not a section in the base config")
    node[parts[-1]] = value


def _read_rows(table: Path) -> list[Row]:
    """The rows an earlier run of the study recorded in `table`. A link there (planted: it is not
    followed) or a line that is not a row (a write cut short by a kill) is logged and skipped."""
    try:
        fd = os.open(table, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("%s: not read (%s); the study starts afresh", table, e.strerror or e)
        return []
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(Row(**json.loads(line)))
        except (ValueError, TypeError) as e:
            log.warning("%s:%d: not a recorded evaluation (%s); skipped", table, n, e)
    return rows
