"""Vertical SecureBoost (`task: trees`, `data.partition: vertical`) against XGBoost's `hist` on
the joined columns, and what a curious passive party sees.

The parties' CSV files hold integer columns (a shared grid: every party's own cuts are
XGBoost's), so the joint booster must equal the central one up to the fixed-point code of
the encrypted gradients (2^-24 per row)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tests.conftest import lazy_module, skip_module_without

skip_module_without("trees", "xgboost")
xgb = lazy_module("xgboost")
pytest.importorskip("phe", reason="SecureBoost needs python-paillier (extra: vertical)")

import fedcore  # noqa: E402
from fedcore.handlers import secureboost  # noqa: E402
from fedcore.scenarios.vertical_data import train_test_ids  # noqa: E402
from fedcore.kernel.config import load_config  # noqa: E402
from tests.test_trees import _assert_same_trees, _trees  # noqa: E402


def _files(tmp_path, m=90, seed=0, regression=False):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 6, size=(m, 5))
    t = x[:, 0] + x[:, 2] - x[:, 3] + x[:, 4] + rng.normal(size=m)
    y = t if regression else (t > 5).astype(int)
    ids = [f"u{i:03d}" for i in range(m)]
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("id,a0,a1,label\n" + "".join(f"{ids[i]},{x[i, 0]},{x[i, 1]},{y[i]}\n" for i in range(m)))
    b.write_text("id,b0,b1,b2\n" + "".join(f"{ids[i]},{x[i, 2]},{x[i, 3]},{x[i, 4]}\n" for i in range(m)))
    return [str(a), str(b)], ids, x.astype(float), y


def _cfg(files, **over):
    return {"task": "trees", "seed": 0, "data.partition": "vertical", "data.test_size": 0.25,
            "vertical.parties": 2, "vertical.files": files, "vertical.he.key_bits": 512,
            "trees.num_trees": 2, "trees.max_depth": 3, "trees.max_bin": 16, "verbose": 0, **over}


def test_secureboost_equals_central_hist_on_the_joined_columns(tmp_path):
    files, ids, x, y = _files(tmp_path)
    cfg = _cfg(files)
    res = fedcore.run(dict(cfg), outdir=str(tmp_path / "o"))
    train, _ = train_test_ids(ids, load_config(dict(cfg)))
    rows = [ids.index(i) for i in train]
    base = float(y[rows].mean())
    assert res.summary["trees_base_score"] == pytest.approx(base)
    params = {"objective": "binary:logistic", "tree_method": "hist", "max_depth": 3, "eta": 0.3,
              "max_bin": 16, "base_score": base, "nthread": 1}
    central = xgb.train(params, xgb.DMatrix(x[rows], label=y[rows]), 2)
    fed = xgb.Booster(model_file=str(tmp_path / "o" / "final_model.json"))
    _assert_same_trees(_trees(fed), _trees(central))
    np.testing.assert_allclose(fed.predict(xgb.DMatrix(x)), central.predict(xgb.DMatrix(x)), rtol=1e-5)


def test_a_curious_passive_party_sees_only_ciphertexts_and_its_own_splits(tmp_path, monkeypatch):
    """The passive party built from the project's handlers, with each receive logged."""
    files, ids, x, y = _files(tmp_path, seed=1)
    seen: dict[str, list] = {}
    for name in ("passive_key", "passive_gradients", "passive_level", "passive_splits", "passive_done"):
        real = getattr(secureboost, name)

        def spy(party, msg, _real=real, _name=name):
            seen.setdefault(_name, []).append({k: v for k, v in msg.content.items()})
            return _real(party, msg)
        monkeypatch.setattr(secureboost, name, spy)
    fedcore.run(_cfg(files), outdir=str(tmp_path / "o"))
    # the key: the modulus only
    assert [sorted(c) for c in seen["passive_key"]] == [["n"]]
    # gradients: one message a tree, every entry a ciphertext below n^2 (no plaintext field)
    n = int.from_bytes(bytes(seen["passive_key"][0]["n"]), "big")
    for c in seen["passive_gradients"]:
        assert sorted(c) == ["c"]
        vals = [int.from_bytes(bytes(b), "big") for b in c["c"]]
        assert all(0 < v < n * n for v in vals) and len(set(vals)) == len(vals)   # randomised
    # splits: only (node, own feature, own bin), and exactly those the joint booster uses
    own = [tuple(s) for c in seen["passive_splits"] for s in c["splits"].tolist()]
    assert own and all(0 <= j < 3 for _node, j, _b in own)
    fed = json.loads((tmp_path / "o" / "final_model.json").read_text())
    trees = fed["learner"]["gradient_booster"]["model"]["trees"]
    passive_nodes = sum(1 for t in trees for f, lc in zip(t["split_indices"], t["left_children"]) if lc >= 0 and f >= 2)
    assert len(own) == passive_nodes
    # the level requests: open nodes and each row's node, nothing about labels or leaves
    assert all(sorted(c) == ["at", "frontier"] for c in seen["passive_level"])


def _run(tmp_path, cfg, capsys) -> tuple[int, str]:
    """`python -m fedcore.run`'s entry point in this process: its exit code and its stderr."""
    from fedcore.run import main
    code = main(["--cfg", str(cfg), f"outdir={tmp_path / 'o'}", "verbose=0"])
    return code, capsys.readouterr().err


def test_label_column_missing_at_the_active_party_exits_2(tmp_path, capsys):
    files, *_ = _files(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"task: trees\ndata: {{partition: vertical, label_column: target}}\n"
                   f"vertical: {{parties: 2, files: [{files[0]}, {files[1]}]}}\n")
    code, stderr = _run(tmp_path, cfg, capsys)
    assert code == 2, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no column 'target'" in lines[0]


def test_more_bins_than_aligned_rows_exits_2(tmp_path, capsys):
    files, *_ = _files(tmp_path, m=20)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"task: trees\ndata: {{partition: vertical}}\ntrees: {{max_bin: 64}}\n"
                   f"vertical: {{parties: 2, files: [{files[0]}, {files[1]}], he: {{key_bits: 256}}}}\n")
    code, stderr = _run(tmp_path, cfg, capsys)
    assert code == 2, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].count("trees.max_bin: 64 bins for") == 1
