"""Loggers: the run's records, as written to metrics.jsonl, also sent to other tools.

`loggers: [csv, tensorboard, mlflow, wandb]` in the config. Each is a
`Callback` that sees every round's record and the summary; each tool is an
optional dependency (`pip install "fedcore[tensorboard]"`, `[mlflow]`,
`[wandb]`; `csv` needs nothing), imported only when named. The round number is
the step everywhere; nested fields are flattened to dotted names.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import numbers
import os
import time
from pathlib import Path
from typing import Any, Callable

from fedcore.kernel.config import declare
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.files import make_folder, open_append, open_fresh, restrict_files
from fedcore.runtime.monitor import Callback

__all__ = ["LOGGERS", "make_loggers", "CsvLogger", "TensorBoardLogger", "MlflowLogger",
           "WandbLogger", "flat_numbers"]

declare("loggers", list, [], "extra outputs of every round's record: csv (metrics.csv), "
        "tensorboard (<outdir>/tensorboard), mlflow, wandb",
        check=lambda v: next((f"unknown logger {n!r}; known: {', '.join(LOGGERS)}"
                              for n in v if n not in LOGGERS), None))
declare("mlflow.tracking_uri", str, None, "mlflow logger: tracking URI (default: $MLFLOW_TRACKING_URI, "
        "else MLflow's local file store in <outdir>/mlruns)")
declare("mlflow.experiment", str, None, "mlflow logger: experiment name (default: the run's name)")
declare("wandb.project", str, "fedcore", "wandb logger: project")
declare("wandb.entity", str, None, "wandb logger: team or user (default: the logged-in user's)")
declare("wandb.mode", str, None, "wandb logger: online, offline or disabled (default: $WANDB_MODE, "
        "else online)", choices=("online", "offline", "disabled"))


def flat_numbers(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a record, nested mappings flattened to dotted names."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_numbers(value, name + "."))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _flat_cells(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat_cells(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else value
    return out


def _run_folder(name: str, outdir: Path | None) -> Path:
    """The run's folder for a logger that writes there; checked when the run starts, so a
    course that never runs (a deployed client) needs none."""
    if outdir is None:
        raise ConfigError(f"loggers: {name} writes into the run's folder; set outdir")
    return Path(outdir)


class CsvLogger(Callback):
    """`metrics.csv`: one row per round; the header grows when a round brings new fields
    (evaluation rounds), and then the file is rewritten so every row has every column."""

    def __init__(self, outdir: Path | None):
        self.outdir = outdir
        self.columns: list[str] = []
        self.rows: list[dict[str, Any]] = []

    def on_start(self, monitor) -> None:
        self.path = _run_folder("csv", self.outdir) / "metrics.csv"

    def on_record(self, record: dict[str, Any]) -> None:
        row = _flat_cells(record)
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new or len(self.rows) == 1:
            self.columns += new
            with open_fresh(self.path, newline="") as f:
                writer = csv.DictWriter(f, self.columns)
                writer.writeheader()
                writer.writerows(self.rows)
        else:
            with open_append(self.path, newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)


class TensorBoardLogger(Callback):
    """Scalars under `<outdir>/tensorboard`, one tag per numeric field, step = round."""

    def __init__(self, cfg, outdir: Path | None):
        self.cfg, self.outdir, self.writer = cfg, outdir, None

    def on_start(self, monitor) -> None:
        from torch.utils.tensorboard import SummaryWriter
        # SummaryWriter opens the names it is given: its folder is made here, a link there removed
        folder = make_folder(_run_folder("tensorboard", self.outdir) / "tensorboard", replace_link=True)
        self.writer = SummaryWriter(str(folder))
        restrict_files(folder)
        self.writer.add_text("config", "```\n" + json.dumps(self.cfg.as_tree(), indent=1) + "\n```")

    def on_record(self, record: dict[str, Any]) -> None:
        for name, value in flat_numbers(record).items():
            if name != "round":
                self.writer.add_scalar(name, value, global_step=record["round"])
        self.writer.flush()

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.close()


class MlflowLogger(Callback):
    """One MLflow run: the resolved config as params, each record's numbers as metrics."""

    def __init__(self, cfg, outdir: Path | None):
        self.cfg, self.outdir = cfg, outdir
        self.client = self.run_id = None

    def on_start(self, monitor) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        uri = self.cfg["mlflow.tracking_uri"] or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            if self.outdir is None:
                raise ConfigError("mlflow.tracking_uri: the mlflow logger needs a tracking URI or an "
                                  "outdir for its local store")
            uri = (Path(self.outdir).resolve() / "mlruns").as_uri()
            # MLflow 3 keeps its file store only behind this opt-in; it needs no database
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = self.cfg["mlflow.experiment"] or self.cfg["name"]
        experiment = self.client.get_experiment_by_name(name)
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=self.cfg["name"]).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in sorted(self.cfg._values.items())]
        for i in range(0, len(params), 100):   # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def on_record(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, record["round"]) for k, v in flat_numbers(record).items()
                   if k != "round"]
        self.client.log_batch(self.run_id, metrics=metrics)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        stopped = summary.get("stopped_by")
        if stopped:
            self.client.set_tag(self.run_id, "stopped_by", stopped)
        self.client.set_terminated(self.run_id, "KILLED" if stopped == "interrupted" else "FINISHED")


class WandbLogger(Callback):
    """One W&B run: the resolved config, each record logged at step = round, the summary."""

    def __init__(self, cfg, outdir: Path | None):
        self.cfg, self.outdir, self.run = cfg, outdir, None

    def on_start(self, monitor) -> None:
        import wandb
        self.run = wandb.init(project=self.cfg["wandb.project"], entity=self.cfg["wandb.entity"],
                              mode=self.cfg["wandb.mode"], name=self.cfg["name"],
                              dir=str(self.outdir) if self.outdir is not None else None,
                              config=self.cfg.as_tree(), reinit="finish_previous")

    def on_record(self, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in flat_numbers(record).items() if k != "round"},
                     step=record["round"])

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        self.run.summary.update({f"final/{k}": v for k, v in flat_numbers(summary).items()})
        self.run.finish(exit_code=1 if summary.get("stopped_by") == "interrupted" else 0)


# name -> (module it needs, extra that installs it, the Callback class; built as cls(cfg, outdir))
LOGGERS: dict[str, tuple[str | None, str, Callable[[Any, Path | None], Callback]]] = {
    "csv": (None, "", lambda cfg, outdir: CsvLogger(outdir)),
    "tensorboard": ("tensorboard", "tensorboard", TensorBoardLogger),
    "mlflow": ("mlflow", "mlflow", MlflowLogger),
    "wandb": ("wandb", "wandb", WandbLogger),
}


def make_loggers(cfg, outdir: Path | None) -> list[Callback]:
    """The callbacks `loggers` names; a missing package is a one-line config error at once,
    a missing outdir (csv, tensorboard) when the run starts."""
    out = []
    for name in dict.fromkeys(cfg["loggers"]):
        module, extra, build = LOGGERS[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"loggers: {name} needs the '{module}' package: "
                              f"pip install \"fedcore[{extra}]\"")
        out.append(build(cfg, outdir))
    return out
