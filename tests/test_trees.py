"""Federated gradient-boosted trees (`task: trees`) against XGBoost trained centrally.

Expected trees come from `xgboost.train` itself (tree_method hist) on the union of the
clients' rows, or on one client's rows for bagging and cyclic; expected base scores from the
labels' mean computed here. Features with at most `max_bin` distinct values are cut at each
value by XGBoost and by the federated sketch alike, so the trees must be equal."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tests.conftest import lazy_module, skip_module_without

skip_module_without("trees", "xgboost")
xgb = lazy_module("xgboost")
skip_module_without("data", "sklearn")

import fedcore  # noqa: E402
from fedcore.algorithms import trees_core as tc  # noqa: E402
from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.scenarios.data import build_federated_data  # noqa: E402


def _trees(booster) -> list[dict]:
    return json.loads(bytes(booster.save_raw("json")))["learner"]["gradient_booster"]["model"]["trees"]


def _walk(t: dict, i: int = 0):
    """A tree as nested tuples: (feature, threshold, left, right) or the leaf value."""
    if t["left_children"][i] < 0:
        return round(float(t["split_conditions"][i]), 4)
    return (t["split_indices"][i], float(np.float32(t["split_conditions"][i])),
            _walk(t, t["left_children"][i]), _walk(t, t["right_children"][i]))


def _assert_same_trees(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert _walk(a) == _walk(b)
        leaves_a = [v for v, l in zip(a["split_conditions"], a["left_children"]) if l < 0]
        leaves_b = [v for v, l in zip(b["split_conditions"], b["left_children"]) if l < 0]
        np.testing.assert_allclose(leaves_a, leaves_b, rtol=1e-5, atol=1e-6)


def _params(objective, depth, eta, max_bin, base):
    return {"objective": objective, "tree_method": "hist", "max_depth": depth, "eta": eta,
            "max_bin": max_bin, "base_score": base, "nthread": 1, "lambda": 1.0, "min_child_weight": 1.0}


def _union(cfg) -> tuple[np.ndarray, np.ndarray, dict]:
    data = build_federated_data(cfg)
    per = {}
    for cid, c in data.clients.items():
        x = np.concatenate([s.x.double().numpy() for s in (c.train, c.val, c.test)])
        y = np.concatenate([s.y.double().numpy() for s in (c.train, c.val, c.test)])
        per[cid] = (x, y)
    x = np.concatenate([v[0] for v in per.values()])
    y = np.concatenate([v[1] for v in per.values()])
    return x, y, per


# ------------------------------------------------------------------ exact histogram method
@pytest.mark.parametrize("data_type,objective,partition,max_bin", [
    ("breast_cancer", "binary:logistic", "dirichlet", 455),    # 455 rows: <= 455 distinct values
    ("diabetes", "reg:squarederror", "iid", 302),              # every feature has <= 302 distinct values
])
def test_histogram_equals_central_hist(tmp_path, data_type, objective, partition, max_bin):
    over = {"task": "trees", "seed": 3, "federate.client_num": 3, "data.type": data_type,
            "data.partition": partition, "data.test_size": 0.2, "trees.objective": objective,
            "trees.num_trees": 3, "trees.max_depth": 3, "trees.eta": 0.3, "trees.max_bin": max_bin}
    res = fedcore.run(dict(over), outdir=str(tmp_path), verbose=0)
    x, y, _ = _union(load_config(dict(over)))
    base = float(y.mean())
    assert res.summary["trees_base_score"] == pytest.approx(base, rel=1e-12)
    central = xgb.train(_params(objective, 3, 0.3, max_bin, base), xgb.DMatrix(x, label=y), 3)
    fed = xgb.Booster(model_file=str(tmp_path / "final_model.json"))
    _assert_same_trees(_trees(fed), _trees(central))
    d = xgb.DMatrix(x)
    np.testing.assert_allclose(fed.predict(d), central.predict(d), rtol=1e-5, atol=1e-5)


def test_histogram_on_a_shared_grid_uneven_clients():
    """Core level: three clients of very different sizes, integer features (a shared grid)."""
    rng = np.random.default_rng(7)
    x = rng.integers(0, 12, size=(500, 4)).astype(float)
    y = (x[:, 0] - 2 * x[:, 1] + rng.normal(size=500) * 3 > -6).astype(float)
    parts = [(x[:40], y[:40]), (x[40:90], y[40:90]), (x[90:], y[90:])]
    p = tc.Params("binary:logistic", max_depth=4, max_bin=16)
    model, cuts = _federated(parts, p, 0.5, 4)
    assert [list(c) for c in cuts] == [list(np.arange(1, 12, dtype=np.float32)) + [np.float32(22.00001)]] * 4
    central = xgb.train(_params(p.objective, 4, 0.3, 16, 0.5), xgb.DMatrix(x, label=y), 4)
    _assert_same_trees(model["learner"]["gradient_booster"]["model"]["trees"], _trees(central))


def _federated(parts, p: tc.Params, base: float, rounds: int):
    """The histogram method's arithmetic, one client per part, without the message flow."""
    f = parts[0][0].shape[1]
    sketches = [tc.local_sketch(px, 2 * p.max_bin) for px, _ in parts]
    cuts = tc.merge_cuts(np.stack([s[0] for s in sketches]), np.stack([s[1] for s in sketches]), p.max_bin)
    width = max(len(c) for c in cuts)
    model = tc.template(p.xgboost(base), f)
    for _ in range(rounds):
        bst = xgb.Booster(model_file=bytearray(json.dumps(model).encode()))
        per = []
        for px, py in parts:
            g, h = tc.grad_hess(p.objective, bst.predict(xgb.DMatrix(px), output_margin=True), py)
            per.append((tc.bin_rows(px, cuts), g, h))
        tb = tc.TreeBuilder(p, cuts)
        while not tb.done:
            tb.grow(sum(tc.histograms(b, g, h, tc.route(b, tb.wire()), tb.frontier, width) for b, g, h in per))
        model = tc.with_trees(model, [tb.xgboost_tree(0, f)])
    return model, cuts


def test_histogram_equals_xgboosts_own_distributed_hist():
    """XGBoost's distributed `hist` (a rabit tracker, one process per worker, each holding one
    client's rows) grows the trees the federated histogram method grows from the same rows."""
    import multiprocessing as mp
    tracker_mod = pytest.importorskip("xgboost.tracker", reason="this xgboost build has no tracker")
    rng = np.random.default_rng(11)
    x = rng.integers(0, 9, size=(300, 3)).astype(float)
    y = x[:, 0] * 1.5 - x[:, 2] + rng.normal(size=300)
    parts = [(x[:120], y[:120]), (x[120:], y[120:])]
    p = tc.Params("reg:squarederror", max_depth=3, max_bin=16)
    params = _params(p.objective, 3, 0.3, 16, 0.5)
    tracker = tracker_mod.RabitTracker(host_ip="127.0.0.1", n_workers=2)
    tracker.start()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from tests.xgb_worker import distributed_worker
    procs = [ctx.Process(target=distributed_worker, args=(tracker.worker_args(), r, px, py, params, 3, queue))
             for r, (px, py) in enumerate(parts)]
    for proc in procs:
        proc.start()
    try:
        dist = json.loads(queue.get(timeout=120))
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        tracker.wait_for(10)
    model, _ = _federated(parts, p, 0.5, 3)
    _assert_same_trees(model["learner"]["gradient_booster"]["model"]["trees"],
                       dist["learner"]["gradient_booster"]["model"]["trees"])


def test_histogram_gradients_are_xgboosts():
    """grad/hess by hand: squared error m - y, 1; logistic p - y, p (1 - p)."""
    m, y = np.array([0.0, 2.0, -1.0]), np.array([1.0, 0.0, 1.0])
    g, h = tc.grad_hess("reg:squarederror", m, y)
    np.testing.assert_allclose(g, [-1, 2, -2])
    np.testing.assert_allclose(h, [1, 1, 1])
    g, h = tc.grad_hess("binary:logistic", m, y)
    p = 1 / (1 + np.exp(-m))
    np.testing.assert_allclose(g, p - y, rtol=1e-6)
    np.testing.assert_allclose(h, p * (1 - p), rtol=1e-6)


# ------------------------------------------------------------------ bagging and cyclic
def _course(tmp_path, mode, rounds=2):
    over = {"task": "trees", "seed": 1, "federate.client_num": 3, "data.type": "breast_cancer",
            "data.partition": "dirichlet", "data.test_size": 0.2, "trees.mode": mode,
            "trees.num_trees": rounds, "trees.max_depth": 2, "trees.max_bin": 64}
    res = fedcore.run(dict(over), outdir=str(tmp_path), verbose=0)
    _, y, per = _union(load_config(dict(over)))
    fed = xgb.Booster(model_file=str(tmp_path / "final_model.json"))
    return res, float(y.mean()), per, fed


def test_bagging_appends_every_clients_local_trees(tmp_path):
    res, base, per, fed = _course(tmp_path, "bagging")
    got = _trees(fed)
    assert len(got) == 2 * 3 and res.summary["trees_count"] == 6
    params = _params("binary:logistic", 2, 0.3, 64, base)
    for i, cid in enumerate(sorted(per)):        # round 2: each client boosts from the empty booster
        px, py = per[cid]
        _assert_same_trees(got[i:i + 1], _trees(xgb.train(params, xgb.DMatrix(px, label=py), 1)))
    # round 3: each client boosts one tree on top of the three trees of round 2
    first = xgb.Booster(model_file=bytearray(json.dumps(tc.with_trees(
        tc.template(params, 30), got[:3])).encode()))
    for i, cid in enumerate(sorted(per)):
        px, py = per[cid]
        cont = xgb.train({k: v for k, v in params.items() if k != "base_score"},
                         xgb.DMatrix(px, label=py), 1, xgb_model=first.copy())
        _assert_same_trees(got[3 + i:4 + i], _trees(cont)[3:])


def test_cyclic_passes_the_booster_on_in_turn(tmp_path):
    res, base, per, fed = _course(tmp_path, "cyclic", rounds=3)
    got = _trees(fed)
    params = _params("binary:logistic", 2, 0.3, 64, base)
    bst = None
    for cid in sorted(per):                      # client 1, then 2, then 3, each on top of the last
        px, py = per[cid]
        bst = xgb.train(params, xgb.DMatrix(px, label=py), 1, xgb_model=bst)
    _assert_same_trees(got, _trees(bst))
    # the recorded accuracy is the booster's on the server's held-out rows
    data = build_federated_data(load_config({"task": "trees", "seed": 1, "federate.client_num": 3,
                                             "data.type": "breast_cancer", "data.partition": "dirichlet",
                                             "data.test_size": 0.2}))
    tx, ty = data.server_test.x.double().numpy(), data.server_test.y.numpy()
    acc = float(np.mean((fed.predict(xgb.DMatrix(tx)) > 0.5) == (ty == 1)))
    assert res.summary["final_test_acc"] == pytest.approx(acc)


# ------------------------------------------------------------------ bad input: one line, exit 2
def _cli(tmp_path, capsys, *over) -> tuple[int, str]:
    """`python -m fedcore.run`'s entry point in this process (the command itself is tested by
    the docs commands): its exit code and what it wrote to stderr."""
    from fedcore.run import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: trees\n")
    code = main(["--cfg", str(cfg), f"outdir={tmp_path / 'o'}", "verbose=0", "federate.client_num=2", *over])
    return code, capsys.readouterr().err


def _csv(tmp_path, rows: list[str]) -> str:
    p = tmp_path / "t.csv"
    p.write_text("\n".join(rows) + "\n")
    return str(p)


@pytest.mark.parametrize("case", ["non_numeric", "no_label", "bins"])
def test_bad_input_exits_2_in_one_line(tmp_path, capsys, case):
    rows = ["a,b,label"] + [f"{i % 5},{i % 3},{i % 2}" for i in range(20)]
    if case == "non_numeric":
        rows[3] = "x,1,0"
    over = ["data.type=csv", f"data.root={_csv(tmp_path, rows)}", "data.test_size=0"]
    over += {"non_numeric": [], "no_label": ["data.label_column=target"], "bins": ["trees.max_bin=64"]}[case]
    code, stderr = _cli(tmp_path, capsys, *over)
    assert code == 2, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1
    assert {"non_numeric": "non-numeric", "no_label": "'target'", "bins": "trees.max_bin"}[case] in lines[0]
