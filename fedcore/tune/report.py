"""A study's outputs: the trials table (CSV), the best config (YAML), the plot, a summary."""
from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from fedcore.kernel.files import open_fresh, write_atomic
from fedcore.tune.study import Study

__all__ = ["write_outputs", "plot_study"]

log = logging.getLogger("fedcore.tune")


def write_outputs(study: Study, method: str) -> dict[str, Any]:
    """trials.csv, best_config.yaml, study.json and plot.png in the study's outdir."""
    out = study.outdir
    trials = study.trials()
    keys = study.space.keys
    with open_fresh(out / "trials.csv", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", *keys, "objective", "budget", "rounds", "status", "outdir"])
        for t in trials:
            w.writerow([t["trial"], *(t["params"].get(k) for k in keys), t["objective"], t["budget"],
                        t["rounds"], t["status"], t["outdir"]])
    best = study.best()
    write_atomic(out / "best_config.yaml", yaml.safe_dump(study.best_config(), sort_keys=False))
    summary = {
        "method": method,
        "metric": study.objective.metric,
        "direction": "maximize" if study.objective.maximize else "minimize",
        "budget_unit": study.unit,
        "trials": len(trials),
        "evaluations": len({(r.trial, r.budget) for r in study.rows}),
        "rounds_spent": study.rounds_spent,
        "best_trial": best.trial if best else None,
        "best_params": best.extra.get("best_params", best.params) if best else None,
        "best_objective": best.objective if best else None,
        "best_budget": best.budget if best else None,
        "best_config": str(out / "best_config.yaml"),
    }
    write_atomic(out / "study.json", json.dumps(summary, indent=2) + "\n")
    plot_study(study, out / "plot.png")
    return summary


def plot_study(study: Study, path: Path) -> Path | None:
    """Objective of each evaluation against trial number and against rounds spent so far,
    with the best so far as a line. Needs matplotlib (`pip install 'fedcore[plot]'`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("plot: matplotlib is not installed (pip install 'fedcore[plot]'); no %s", path.name)
        return None
    rows = [r for r in study.rows if r.status == "complete"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    spent, xs, ys, best, bests = 0, [], [], None, []
    for r in rows:
        spent += r.rounds
        xs.append(spent)
        ys.append(r.objective)
        if study.objective.better(r.objective, best):
            best = r.objective
        bests.append(best)
    dots = ax1.scatter([r.trial for r in rows], ys, c=[r.budget for r in rows], cmap="viridis", s=18)
    fig.colorbar(dots, ax=ax1, label=f"budget ({study.unit.replace('_', ' ')})")
    ax1.set_xlabel("trial")
    ax1.set_ylabel(study.objective.metric)
    ax1.set_title("each evaluation")
    ax2.scatter(xs, ys, s=12, alpha=0.6, label="evaluation")
    ax2.step(xs, bests, where="post", color="C3", label="best so far (any budget)")
    ax2.set_xlabel("rounds spent by the study")
    ax2.set_ylabel(study.objective.metric)
    ax2.legend()
    fig.tight_layout()
    image = io.BytesIO()   # matplotlib opens the name it is given; the file is written here instead
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    write_atomic(path, image.getvalue())
    return path
