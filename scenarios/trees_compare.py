"""Compare federated trees with their bounds: local-only, bagging, cyclic, exact histogram and
centralized XGBoost, each scored on the server's held-out rows of one `task: trees` config.

    python -m fedcore.scenarios.trees_compare [--cfg scenarios/xgboost_horizontal.yaml] [KEY=VALUE ...]

Local-only boosts `trees.num_trees` trees on each client's rows alone (mean, min and max over
clients); centralized boosts them on the union with the federated base score and cuts of
XGBoost's own sketch. Prints one markdown table.
"""
from __future__ import annotations

import argparse
import tempfile

import numpy as np

__all__ = ["main", "compare"]


def _metrics(booster, x: np.ndarray, y: np.ndarray, objective: str) -> float:
    from fedcore.handlers.trees import score
    from fedcore.scenarios.data import Split
    import torch
    out = score(bytes(booster.save_raw("json")), Split(torch.from_numpy(x), torch.from_numpy(y)), objective)
    return out["test_acc" if objective == "binary:logistic" else "test_rmse"]


def compare(cfg_path: str, overrides: list[str]) -> list[tuple[str, str, int]]:
    """(method, metric text, trees) rows, in the table's order."""
    import xgboost as xgb
    import fedcore
    from fedcore.algorithms.trees import params_of, table_of
    from fedcore.kernel.config import load_config, parse_override
    from fedcore.scenarios.data import build_federated_data
    cfg = load_config(cfg_path, overrides)
    objective, n = cfg["trees.objective"], cfg["trees.num_trees"]
    data = build_federated_data(cfg)
    tx, ty = data.server_test.x.flatten(1).double().numpy(), data.server_test.y.double().numpy()
    parts = [table_of(data.clients[c]) for c in sorted(data.clients)]
    ux, uy = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("histogram", "bagging", "cyclic"):
            res = fedcore.run(cfg_path, outdir=f"{tmp}/{mode}", verbose=0, **{"trees.mode": mode},
                              **dict(parse_override(o) for o in overrides))
            bst = xgb.Booster(model_file=f"{tmp}/{mode}/final_model.json")
            rows.append((mode, _metrics(bst, tx, ty, objective), res.summary["trees_count"]))
            base = res.summary["trees_base_score"]
    params = {**params_of(cfg).xgboost(base), "nthread": 1, "seed": cfg["seed"]}
    local = [_metrics(xgb.train(params, xgb.DMatrix(x, label=y), n), tx, ty, objective) for x, y in parts]
    central = xgb.train(params, xgb.DMatrix(ux, label=uy), n)
    return ([("local-only", local, n)] + rows + [("centralized", _metrics(central, tx, ty, objective), n)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedcore.scenarios.trees_compare", description=__doc__.split("\n")[0])
    p.add_argument("--cfg", default="scenarios/xgboost_horizontal.yaml")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    from fedcore.kernel.config import load_config
    metric = "test accuracy" if load_config(a.cfg, a.overrides)["trees.objective"] == "binary:logistic" else "test RMSE"
    print(f"| method | {metric} | trees |\n|---|---|---|")
    for name, value, trees in compare(a.cfg, a.overrides):
        text = (f"{np.mean(value):.4f} (clients {min(value):.4f} to {max(value):.4f})"
                if isinstance(value, list) else f"{value:.4f}")
        print(f"| {name} | {text} | {trees} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
