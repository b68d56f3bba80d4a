"""A regression course on a user's CSV keeps its labels as numbers: the federated exact-histogram
booster equals XGBoost's `hist` trained centrally on the same rows (the rows and their split
across clients are read here from the file and the partition's seed, not from the course)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tests.conftest import lazy_module, skip_module_without

skip_module_without("trees", "xgboost")
xgb = lazy_module("xgboost")

import fedcore  # noqa: E402
from fedcore.run import main  # noqa: E402


def _trees(model: dict) -> list[dict]:
    return model["learner"]["gradient_booster"]["model"]["trees"]


def _walk(t: dict, i: int = 0):
    if t["left_children"][i] < 0:
        return None
    return (t["split_indices"][i], float(np.float32(t["split_conditions"][i])),
            _walk(t, t["left_children"][i]), _walk(t, t["right_children"][i]))


def _leaves(t: dict) -> list[float]:
    return [v for v, l in zip(t["split_conditions"], t["left_children"]) if l < 0]


def _table(n: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Integer features (a shared grid, so federated and central cuts agree) and real labels."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 7, size=(n, 3)).astype(float)
    y = np.round(2.5 * x[:, 0] - 1.25 * x[:, 2] + rng.normal(size=n) * 0.7 + 0.3, 3)
    return x, y


def _write(path, x, y, label="target") -> str:
    lines = [f"a,b,c,{label}"] + [f"{int(r[0])},{int(r[1])},{int(r[2])},{float(v)!r}" for r, v in zip(x, y)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_csv_regression_equals_central_hist(tmp_path):
    x, y = _table()
    over = {"task": "trees", "seed": 2, "federate.client_num": 3, "data.type": "csv",
            "data.root": _write(tmp_path / "t.csv", x, y), "data.label_column": "target",
            "data.test_size": 0, "trees.objective": "reg:squarederror", "trees.num_trees": 3,
            "trees.max_depth": 3, "trees.max_bin": 8, "verbose": 0}
    res = fedcore.run(over, outdir=str(tmp_path / "out"))
    assert res.summary["trees_base_score"] == pytest.approx(float(y.mean()), rel=1e-12)  # not a class mean
    params = {"objective": "reg:squarederror", "tree_method": "hist", "max_depth": 3, "eta": 0.3,
              "max_bin": 8, "base_score": float(y.mean()), "nthread": 1, "lambda": 1.0, "min_child_weight": 1.0}
    central = json.loads(bytes(xgb.train(params, xgb.DMatrix(x, label=y), 3).save_raw("json")))
    fed = json.loads((tmp_path / "out" / "final_model.json").read_text())
    assert len(_trees(fed)) == 3
    for a, b in zip(_trees(fed), _trees(central)):
        assert _walk(a) == _walk(b) and _walk(a) is not None
        np.testing.assert_allclose(_leaves(a), _leaves(b), rtol=1e-5, atol=1e-6)


def _cli(tmp_path, capsys, *over) -> tuple[int, str]:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: trees\ntrees: {objective: 'reg:squarederror'}\n")
    code = main(["--cfg", str(cfg), f"outdir={tmp_path / 'o'}", "verbose=0", "federate.client_num=2",
                 "data.type=csv", "data.test_size=0", *over])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case,expected", [("label", "non-numeric label"), ("feature", "non-numeric"),
                                           ("missing", "'target'"), ("bins", "trees.max_bin"),
                                           ("partition", "data.partition")])
def test_bad_regression_csv_exits_2_in_one_line(tmp_path, capsys, case, expected):
    x, y = _table(20)
    path = tmp_path / "t.csv"
    _write(path, x, y, label="y" if case == "missing" else "target")
    lines = path.read_text().splitlines()
    if case == "label":
        lines[4] = "1,2,3,high"
    if case == "feature":
        lines[4] = "1,two,3,0.5"
    path.write_text("\n".join(lines) + "\n")
    extra = {"bins": ["trees.max_bin=64"], "partition": ["data.partition=dirichlet"]}.get(case, [])
    code, stderr = _cli(tmp_path, capsys, f"data.root={path}", "data.label_column=target", *extra)
    assert code == 2, stderr
    err = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and expected in err[0], err
