"""`python -m fedcore.plot RUN_DIR [RUN_DIR ...] --x KEY --y KEY [-o FILE]`: curves of runs.

One curve per run, read from its `metrics.jsonl` (rounds without the y field,
e.g. rounds without evaluation, are skipped); the legend names each run by its
config's `name` (by its folder where names repeat). `--x bytes` is the
cumulative training traffic, up plus down. The format follows the file's
suffix (png, svg, pdf, ...). Needs matplotlib: `pip install "fedcore[plot]"`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

from fedcore.kernel.errors import EXIT_OK, ConfigError, FedcoreError

__all__ = ["X_AXES", "new_figure", "read_run", "draw_runs", "plot_runs", "main"]

# --x names and the record field each reads ("bytes" is computed when a run predates bytes_total)
X_AXES = {"round": "round", "virtual_time": "virtual_time", "wall_time": "wall_time",
          "bytes": "bytes_total"}
_AXIS_LABELS = {"round": "round", "virtual_time": "virtual time (s)", "wall_time": "wall time (s)",
                "bytes": "bytes sent, up + down (cumulative)"}


def new_figure(width: float = 6.4, height: float = 4.2):
    """A matplotlib Figure not tied to pyplot's global state (safe in scripts and servers)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError('plotting needs matplotlib: pip install "fedcore[plot]"') from None
    return Figure(figsize=(width, height), layout="constrained")


def read_run(run_dir: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """A run folder's name (from config.yaml, else the folder's) and its records."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl; give the folder of a run (its outdir)")
    records = []
    for n, line in enumerate(metrics.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(f"'{metrics}' line {n} is not JSON") from None
    name = run_dir.name
    cfg_file = run_dir / "config.yaml"
    if cfg_file.is_file():
        import yaml
        tree = yaml.safe_load(cfg_file.read_text()) or {}
        name = tree.get("name") or name
    return name, records


def _series(records: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    xs, ys, sent = [], [], 0
    for r in records:
        sent += r.get("bytes_up", 0) + r.get("bytes_down", 0)
        xv = r.get(X_AXES.get(x, x))
        if x == "bytes" and xv is None:
            xv = sent
        if xv is not None and r.get(y) is not None:
            xs.append(xv)
            ys.append(r[y])
    return xs, ys


def draw_runs(runs: Iterable[str | Path], x: str = "round", y: str = "test_acc",
              labels: list[str] | None = None, title: str | None = None):
    """A Figure with `y` against `x` for each run folder, one curve each."""
    runs = [Path(r) for r in runs]
    if not runs:
        raise ConfigError("plot: give at least one run folder")
    loaded = [read_run(r) for r in runs]
    if labels is None:
        names = [name for name, _ in loaded]
        labels = names if len(set(names)) == len(names) else [str(r) for r in runs]
    elif len(labels) != len(runs):
        raise ConfigError(f"--label: {len(labels)} labels for {len(runs)} runs")
    fig = new_figure()
    ax = fig.subplots()
    for run, label, (_, records) in zip(runs, labels, loaded):
        xs, ys = _series(records, x, y)
        if not ys:
            keys = sorted({k for r in records for k, v in r.items() if isinstance(v, (int, float))})
            raise ConfigError(f"--y/--x: run '{run}' has no rounds with both '{x}' and '{y}'; "
                              f"its fields: {', '.join(keys)}")
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=label)
    ax.set_xlabel(_AXIS_LABELS.get(x, x))
    ax.set_ylabel(y)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    return fig


def plot_runs(runs: Iterable[str | Path], x: str = "round", y: str = "test_acc",
              out: str | Path | None = None, labels: list[str] | None = None,
              title: str | None = None) -> Path:
    """Draw `y` against `x` for each run folder and save it; returns the file written
    (default `<y>_vs_<x>.png`; the suffix picks the format)."""
    fig = draw_runs(runs, x, y, labels, title)
    out = Path(out) if out is not None else Path(f"{y}_vs_{x}.png")
    try:
        fig.savefig(out)
    except (OSError, ValueError) as exc:   # unwritable place, unknown format
        raise ConfigError(f"-o: cannot write '{out}' ({exc})") from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedcore.plot",
                                description="Draw a curve per run from its metrics.jsonl.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (each run's outdir)")
    p.add_argument("--x", default="round", help=f"x axis: {', '.join(X_AXES)} or any record field "
                   "(default: round)")
    p.add_argument("--y", default="test_acc", help="y axis: any record field, e.g. test_acc, "
                   "test_loss, client_test_acc_mean (default: test_acc)")
    p.add_argument("-o", "--out", help="file to write; its suffix picks the format "
                   "(default: <y>_vs_<x>.png)")
    p.add_argument("--label", nargs="+", help="legend entries, one per run (default: run names)")
    p.add_argument("--title", help="the plot's title")
    args = p.parse_args(argv)
    try:
        out = plot_runs(args.runs, args.x, args.y, args.out, args.label, args.title)
    except FedcoreError as exc:
        print(f"fedcore: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"wrote {out} ({len(args.runs)} curve{'s' if len(args.runs) > 1 else ''}, "
          f"{args.y} against {args.x})")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
