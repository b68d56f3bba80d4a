"""The Python API: run a course from a script or a notebook and get its results back.

    import fedcore
    result = fedcore.run("scenarios/quickstart.yaml", federate__total_round_num=20)
    result.summary["final_test_acc"], result.curve("test_acc")

`run` takes what `python -m fedcore.run` takes (files, overrides) and also
mappings, writes the same outputs, and returns a `RunResult` instead of an
exit code; errors are raised (`fedcore.kernel.errors.ConfigError`, ...), not printed.
"""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from fedcore.kernel.config import Config, load_config
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.monitor import Callback

__all__ = ["run", "configure", "RunResult", "resolve_outdir"]


def resolve_outdir(cfg) -> Path:
    """`outdir`, or runs/<timestamp>-<name> where it is unset."""
    if cfg["outdir"]:
        return Path(cfg["outdir"])
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg['name']}"


@dataclass
class RunResult:
    """What a finished simulation leaves: its records, summary, final model and where it wrote."""

    records: list[dict[str, Any]]           # one per aggregation round, as in metrics.jsonl
    summary: dict[str, Any]                 # as in summary.json
    final_model: dict[str, torch.Tensor]    # the final global state_dict, as in final_model.pt
    outdir: Path | None
    config: Config | None = None            # the resolved config (None when loaded from disk)

    def curve(self, y: str = "test_acc", x: str = "round") -> tuple[list[float], list[float]]:
        """(xs, ys) over the records that have both fields (evaluation rounds, for test_*); a
        field no record has is a KeyError naming those the records have."""
        for field in (x, y):
            if self.records and not any(field in r for r in self.records):
                known = sorted({k for r in self.records for k in r})
                raise KeyError(f"no record has '{field}'; the records have {', '.join(known)}")
        rows = [r for r in self.records if r.get(x) is not None and r.get(y) is not None]
        return [r[x] for r in rows], [r[y] for r in rows]

    @classmethod
    def load(cls, outdir: str | Path) -> "RunResult":
        """Read a finished run's folder back (metrics.jsonl, summary.json, final_model.pt)."""
        outdir = Path(outdir)
        try:
            records = [json.loads(line) for line in (outdir / "metrics.jsonl").read_text().splitlines()
                       if line.strip()]
            summary = json.loads((outdir / "summary.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"'{outdir}' is not a finished run's folder ({exc})") from None
        model = outdir / "final_model.pt"
        final = torch.load(model, weights_only=True, map_location="cpu") if model.is_file() else {}
        return cls(records, summary, final, outdir)


def _sources(cfg_or_path, overrides: dict[str, Any]) -> tuple[list, dict[str, Any]]:
    items = list(cfg_or_path) if isinstance(cfg_or_path, (list, tuple)) else (
        [] if cfg_or_path is None else [cfg_or_path])
    return items, {k.replace("__", "."): v for k, v in overrides.items()}


def configure(cfg_or_path: str | Path | dict | Iterable | Config | None = None, /,
           **overrides: Any) -> Config:
    """A validated config: YAML paths and mappings (nested or dotted keys) merged in order,
    then `overrides` (keyword names use `__` for `.`: `train__optimizer__lr=0.1`)."""
    if isinstance(cfg_or_path, Config):
        return cfg_or_path.with_overrides(**overrides) if overrides else cfg_or_path
    items, extra = _sources(cfg_or_path, overrides)
    return load_config(items, extra=extra, extra_source="fedcore.run() arguments", named_by="config")


def run(cfg_or_path: str | Path | dict | Iterable | Config | None = None, /, *,
        callbacks: Iterable[Callback] = (), **overrides: Any) -> RunResult:
    """Run a simulated course to its end and return its `RunResult`.

    `cfg_or_path` and `overrides` as in `configure()`. The run writes the usual outputs to
    `outdir` (default `runs/<timestamp>-<name>`) and shows progress as `verbose` says;
    `callbacks` (`fedcore.runtime.monitor.Callback`) see every record and the summary as they come.
    Ctrl-C lets the round end and writes its checkpoint (a second one stops at once), then
    summary.json and final_model.pt, and raises KeyboardInterrupt.
    """
    from fedcore.runtime.course import Course
    cfg = configure(cfg_or_path, **overrides)
    if cfg["federate.mode"] != "standalone" or cfg["distribute.role"] is not None:
        raise ConfigError("federate.mode: fedcore.run() simulates a course in this process; run "
                          "deployed roles with python -m fedcore.run or fedcore.launch")
    outdir = resolve_outdir(cfg)
    course = Course(cfg, outdir, progress=cfg["verbose"], callbacks=list(callbacks))
    summary = course.run()
    final = {k: v.detach().clone() for k, v in course.server.aggregator.global_state.items()}
    return RunResult([dict(r) for r in course.monitor.records], summary, final, outdir, cfg)
