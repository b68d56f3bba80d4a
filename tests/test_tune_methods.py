"""Search methods on a tiny course whose good learning-rate region is known.

The course: an MLP (16 hidden units) trained with FedAvg by 8 clients on
synthetic_iid data, 9 rounds. A 13-point log grid of lr in [1e-4, 100] gives
the best validation accuracy 0.925 at lr = 1, and >= 0.9 only for lr in
[1, 3.2] of the grid (0.84 at 0.32, 0.58 at 10): the good region is taken as
lr in [0.5, 4].
"""
import importlib.util
import json

import pytest
import yaml

from fedcore.kernel.config import load_config
from fedcore.tune import tune
from fedcore.tune.runner import read_run

GOOD = (0.5, 4.0)
BASE = {
    "seed": 0, "federate.client_num": 8, "federate.total_round_num": 9,
    "data.type": "synthetic", "data.partition": "natural", "data.splits": [0.6, 0.2, 0.2],
    "data.synthetic.samples_per_client": 50, "data.synthetic.dim": 10,
    "data.synthetic.num_classes": 4, "data.synthetic.iid": True,
    "model.type": "mlp", "model.hidden": [16], "train.batch_size": 10, "train.local_steps": 3,
    "eval.clients": False,
}
SPACE = {"train.optimizer.lr": {"type": "float", "low": 1e-4, "high": 100.0, "log": True, "grid": 13}}


def _records(outdir):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in read_run(outdir).records]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    return tune(BASE, SPACE, "grid", outdir=tmp_path_factory.mktemp("grid"))


def test_grid_maps_the_known_region(grid):
    by_lr = {t["params"]["train.optimizer.lr"]: t["objective"] for t in grid.trials}
    # lr = 100 diverges: that course stops (exit 5) after its finite rounds plus the one that
    # diverged; every other trial runs its 9 rounds
    diverged = [t for t in grid.trials if t["status"] == "diverged"]
    assert [t["params"]["train.optimizer.lr"] for t in diverged] == [100.0] and 1 <= diverged[0]["rounds"] < 9
    assert all(t["status"] == "complete" and t["rounds"] == 9 for t in grid.trials if t not in diverged)
    spent = 12 * 9 + diverged[0]["rounds"]
    assert len(by_lr) == 13 and grid.rounds_spent == spent
    assert grid.best_params == {"train.optimizer.lr": 1.0} and grid.best_objective == 0.925
    good = [lr for lr, acc in by_lr.items() if acc >= 0.9]
    assert good == [1.0, 3.16227766017]
    # outputs: table, best config (loadable, with the best lr), study summary, plot
    out = grid.outdir
    assert (out / "trials.csv").read_text().count("\n") == 14
    best = yaml.safe_load(grid.best_config.read_text())
    cfg = load_config(grid.best_config)
    assert cfg["train.optimizer.lr"] == 1.0 and cfg["eval.val"] and best["federate"]["total_round_num"] == 9
    assert json.loads((out / "study.json").read_text())["rounds_spent"] == spent
    if importlib.util.find_spec("matplotlib"):   # the plot extra; without it the study has no plot
        assert (out / "plot.png").stat().st_size > 1000
    else:
        assert not (out / "plot.png").exists()
    assert len(list((out / "trials").iterdir())) == 13 and (out / "trials/0007/metrics.jsonl").is_file()


def test_successive_halving_reaches_grids_best_region_with_fewer_rounds(grid, tmp_path):
    sha = tune(BASE, SPACE, "sha", sample="grid", outdir=tmp_path)   # the same 13 points, rungs 1, 3, 9
    lr = sha.best_params["train.optimizer.lr"]
    assert GOOD[0] <= lr <= GOOD[1] and sha.best_objective >= 0.9
    assert sha.rounds_spent == 13 * 1 + 4 * 2 + 1 * 6 == 27
    # grid search in its own order first reaches this objective after 9 trials (lr = 1)
    rows = json.loads(json.dumps(grid.trials))
    spent = next(9 * (i + 1) for i, t in enumerate(rows) if t["objective"] >= sha.best_objective)
    assert spent == 81 > sha.rounds_spent
    stopped = [t for t in sha.trials if t["status"] == "stopped"]
    assert len(stopped) == 12
    # from 9 random draws (rungs 1, 3, 9): 9 + 3*2 + 1*6 rounds
    drawn = tune(BASE, SPACE, "sha", trials=9, seed=0, outdir=tmp_path / "random")
    assert GOOD[0] <= drawn.best_params["train.optimizer.lr"] <= GOOD[1] and drawn.best_objective >= 0.9
    assert drawn.rounds_spent == 21


def test_a_promoted_trial_continues_its_course_from_its_checkpoint(grid, tmp_path):
    sha = tune(BASE, SPACE, "sha", sample="grid", outdir=tmp_path)
    best = next(t for t in sha.trials if t["status"] == "complete")
    folder = tmp_path / "trials" / f"{best['trial']:04d}"
    assert sorted(p.name for p in (folder / "checkpoints").glob("round_*")) == ["round_1.pt", "round_3.pt", "round_9.pt"]
    rows = [json.loads(x) for x in (tmp_path / "trials.jsonl").read_text().splitlines()]
    mine = [r for r in rows if r["trial"] == best["trial"]]
    assert [(r["budget"], r["rounds"], r["last_round"]) for r in mine] == [(1, 1, 1), (3, 2, 3), (9, 6, 9)]
    # one continuous course: rounds 1..9, equal to the grid's uninterrupted run of the same lr
    records = _records(folder)
    assert [r["round"] for r in records] == list(range(1, 10))
    twin = next(t for t in grid.trials if t["params"] == best["params"])
    assert records == _records(twin["outdir"])


def test_random_search_is_reproducible_with_its_seed(tmp_path):
    base = dict(BASE, **{"federate.total_round_num": 2})
    a = tune(base, SPACE, "random", trials=3, seed=5, outdir=tmp_path / "a")
    b = tune(base, SPACE, "random", trials=3, seed=5, outdir=tmp_path / "b")
    c = tune(base, SPACE, "random", trials=3, seed=6, outdir=tmp_path / "c")
    strip = lambda r: [(t["params"], t["objective"]) for t in r.trials]  # noqa: E731
    assert strip(a) == strip(b) and [p for p, _ in strip(a)] != [p for p, _ in strip(c)]


def test_an_interrupted_study_resumes_and_runs_only_what_is_missing(tmp_path):
    base = dict(BASE, **{"federate.total_round_num": 2})
    first = tune(base, SPACE, "random", trials=2, seed=3, outdir=tmp_path)
    stamp = (tmp_path / "trials/0000/metrics.jsonl").stat().st_mtime_ns
    more = tune(base, SPACE, "random", trials=4, seed=3, outdir=tmp_path)
    assert [t["params"] for t in more.trials][:2] == [t["params"] for t in first.trials]
    assert (tmp_path / "trials/0000/metrics.jsonl").stat().st_mtime_ns == stamp      # not run again
    assert len((tmp_path / "trials.jsonl").read_text().splitlines()) == 4
    other = {"train.optimizer.lr": {"type": "float", "low": 0.5, "high": 0.6}}
    with pytest.raises(Exception, match="holds a study whose trial 0 had"):
        tune(base, other, "random", trials=2, seed=3, outdir=tmp_path)


@pytest.mark.slow
def test_parallel_trials_give_the_same_results(tmp_path):
    base = dict(BASE, **{"federate.total_round_num": 2})
    space = {"train.optimizer.lr": {"type": "choice", "values": [0.1, 1.0]}}
    one = tune(base, space, "grid", outdir=tmp_path / "one")
    two = tune(base, space, "grid", outdir=tmp_path / "two", parallel=2)
    assert [(t["params"], t["objective"]) for t in one.trials] == [(t["params"], t["objective"]) for t in two.trials]
    assert _records(tmp_path / "one/trials/0001") == _records(tmp_path / "two/trials/0001")


@pytest.mark.extra("tune")
def test_tpe_finds_the_good_region(tmp_path):
    result = tune(BASE, SPACE, "tpe", trials=6, seed=0, outdir=tmp_path)
    found = [t for t in result.trials if GOOD[0] <= t["params"]["train.optimizer.lr"] <= GOOD[1]]
    assert found and found[0]["trial"] < 6
    assert GOOD[0] <= result.best_params["train.optimizer.lr"] <= GOOD[1]
    assert (tmp_path / "optuna.db").is_file()
    # resumed from Optuna's storage and the study's rows: two more trials, the first 6 kept
    more = tune(BASE, SPACE, "tpe", trials=8, seed=0, outdir=tmp_path)
    assert [t["params"] for t in more.trials][:6] == [t["params"] for t in result.trials]
    assert len(more.trials) == 8 and more.rounds_spent == 8 * 9
    assert len((tmp_path / "trials.jsonl").read_text().splitlines()) == 8


def test_the_command_line_runs_a_study(tmp_path, capsys):
    import yaml as _yaml
    from fedcore.tune.__main__ import main
    base, space = tmp_path / "base.yaml", tmp_path / "space.yaml"
    tree = {}
    for k, v in dict(BASE, **{"federate.total_round_num": 2}).items():
        node = tree
        for part in k.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[k.split(".")[-1]] = v
    base.write_text(_yaml.safe_dump(tree))
    space.write_text("train:\n  optimizer:\n    lr: {type: choice, values: [0.01, 1.0]}\n")
    rc = main(["--cfg", str(base), "--space", str(space), "--method", "grid", "--outdir", str(tmp_path / "s")])
    out = capsys.readouterr().out
    assert rc == 0 and "grid: best val_acc" in out and "{'train.optimizer.lr': 1.0}" in out
    assert load_config(tmp_path / "s/best_config.yaml")["federate.total_round_num"] == 2


def test_a_base_config_is_read_as_the_run_reads_it_defaults_merged_and_empty_refused(tmp_path, capsys):
    from fedcore.tune.__main__ import main
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "common.yaml").write_text(yaml.safe_dump(dict(BASE, **{"federate.total_round_num": 2})))
    (folder / "study.yaml").write_text("defaults: [common.yaml]\nmodel:\n  hidden: [8]\n")
    space = tmp_path / "space.yaml"
    space.write_text("train:\n  optimizer:\n    lr: {type: choice, values: [1.0]}\n")
    # base.yaml is written into the study's folder, away from common.yaml: the defaults are
    # merged before it is, as `fedcore.run --cfg configs/study.yaml` merges them
    rc = main(["--cfg", str(folder / "study.yaml"), "--space", str(space), "--method", "grid",
               "--outdir", str(tmp_path / "s")])
    assert rc == 0, capsys.readouterr()
    best = load_config(tmp_path / "s/best_config.yaml")
    assert best["model.hidden"] == [8] and best["federate.client_num"] == 8
    ran = load_config(folder / "study.yaml", ["train.optimizer.lr=1.0"])
    assert all(best[k] == ran[k] for k in ("data.synthetic.dim", "train.local_steps", "train.optimizer.lr",
                                           "federate.total_round_num", "eval.clients"))
    (folder / "empty.yaml").write_text("")
    rc = main(["--cfg", str(folder / "empty.yaml"), "--space", str(space), "--method", "grid",
               "--outdir", str(tmp_path / "e")])
    assert rc == 2 and "is empty" in capsys.readouterr().err


def test_virtual_time_budget_and_test_metric_warning(tmp_path, caplog):
    space = {"train.optimizer.lr": {"type": "choice", "values": [0.3, 1.0, 3.0]}}
    probe = tune(dict(BASE, **{"federate.total_round_num": 3}), {"train.optimizer.lr": {"type": "choice", "values": [1.0]}},
                 "grid", metric="test_acc", outdir=tmp_path / "probe")
    assert "selecting a configuration on test data" in caplog.text
    per_round = read_run(probe.trials[0]["outdir"]).records[0]["virtual_time"]
    budget = 4.5 * per_round        # rounds end at whole multiples: the 5th crosses it
    sha = tune(BASE, space, "sha", sample="grid", budget=budget, budget_unit="virtual_time",
               min_budget=budget / 3, outdir=tmp_path / "sha")
    best = next(t for t in sha.trials if t["status"] == "complete")
    records = read_run(best["outdir"]).records
    assert records[-1]["virtual_time"] >= budget > records[-2]["virtual_time"]
    assert [r["round"] for r in records] == list(range(1, len(records) + 1))
    # each stopped trial ran until its clock crossed the first rung; no round ran twice
    for t in sha.trials:
        rec = read_run(t["outdir"]).records
        assert rec[-1]["virtual_time"] >= t["budget"] > rec[-2]["virtual_time"]
    assert sha.rounds_spent == sum(len(read_run(t["outdir"]).records) for t in sha.trials)
    assert len(list((tmp_path / "sha" / "trials" / f"{best['trial']:04d}" / "checkpoints").glob("round_*"))) == 1
