"""The search space: parsing, one-line errors (exit 2), seeded sampling and grids."""
import numpy as np
import pytest

from fedcore.kernel.errors import ConfigError
from fedcore.tune.__main__ import main as tune_main
from fedcore.tune.space import load_space


def _cli(argv) -> int:
    try:
        return tune_main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return exc.code


def _space(tmp_path, text):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


def test_parses_floats_ints_choices_dotted_or_nested(tmp_path):
    space = load_space(_space(tmp_path, """
train.optimizer.lr: {type: float, low: 0.001, high: 1.0, log: true}
train:
  local_steps: {type: int, low: 1, high: 4}
  optimizer:
    type: {type: choice, values: [sgd, adam]}
"""))
    assert space.keys == ["train.optimizer.lr", "train.local_steps", "train.optimizer.type"]
    lr, steps, opt = space.params
    assert (lr.type, lr.low, lr.high, lr.log) == ("float", 0.001, 1.0, True)
    assert steps.grid_values() == [1, 2, 3, 4]
    assert opt.grid_values() == ["sgd", "adam"]
    assert lr.grid_values() == [0.001, 0.00562341325190, 0.0316227766017, 0.177827941004, 1.0]
    assert len(space.grid()) == 5 * 4 * 2 and space.grid()[0] == {
        "train.optimizer.lr": 0.001, "train.local_steps": 1, "train.optimizer.type": "sgd"}


def test_random_draws_are_reproducible_with_the_seed_and_stay_in_range(tmp_path):
    space = load_space(_space(tmp_path, """
train.optimizer.lr: {type: float, low: 0.001, high: 1.0, log: true}
train.local_steps: {type: int, low: 1, high: 50, log: true}
train.optimizer.momentum: {type: float, low: 0.0, high: 0.9}
train.optimizer.type: {type: choice, values: [sgd, adam]}
"""))
    a = [space.sample(np.random.default_rng(7)) for _ in range(1)] + \
        [space.sample(r) for r in [np.random.default_rng(7)] for _ in range(20)]
    b = [space.sample(np.random.default_rng(7)) for _ in range(1)] + \
        [space.sample(r) for r in [np.random.default_rng(7)] for _ in range(20)]
    assert a == b
    c = [space.sample(r) for r in [np.random.default_rng(8)] for _ in range(20)]
    assert c != a[1:]
    for d in a:
        assert 0.001 <= d["train.optimizer.lr"] <= 1.0 and 1 <= d["train.local_steps"] <= 50
        assert isinstance(d["train.local_steps"], int) and 0 <= d["train.optimizer.momentum"] <= 0.9
    # log-uniform: about half the draws of [1e-3, 1] fall below its geometric middle 10^-1.5
    rng = np.random.default_rng(0)
    lrs = [space.params[0].sample(rng) for _ in range(2000)]
    assert 0.45 < np.mean([x < 10 ** -1.5 for x in lrs]) < 0.55


@pytest.mark.parametrize("text, expected", [
    ("train.optimizer.lrr: {type: float, low: 0.1, high: 1.0}",
     "unknown config key 'train.optimizer.lrr' (did you mean 'train.optimizer.lr'?)"),
    ("train.optimizer.lr: {type: float, low: 1.0, high: 0.1}", "low (1.0) must be below high (0.1)"),
    ("train.optimizer.lr: {type: float, low: 0.0, high: 1.0, log: true}", "a log range needs low > 0"),
    ("train.optimizer.lr: {type: float, low: -1.0, high: 1.0}", "train.optimizer.lr: must be > 0"),
    ("train.local_steps: {type: int, low: 1.5, high: 4}", "'low' must be an int"),
    ("train.optimizer.type: {type: float, low: 0.1, high: 1.0}", "is a str key"),
    ("train.optimizer.type: {type: choice, values: [sgd, rmsprop]}", "'rmsprop' is not one of"),
    ("train.optimizer.lr: {type: uniform, low: 0.1, high: 1.0}", "needs {type: float|int|choice"),
    ("train.optimizer.lr: {type: float, low: 0.1, high: 1.0, step: 2}", "unknown field 'step'"),
    ("train.optimizer.type: {type: choice, values: []}", "non-empty list"),
    ("{}", "names no config key"),
])
def test_bad_spaces_exit_2_with_one_line(tmp_path, capsys, text, expected):
    space = _space(tmp_path, text)
    with pytest.raises(ConfigError, match=None) as info:
        load_space(space)
    assert expected in str(info.value)
    base = tmp_path / "base.yaml"
    base.write_text("federate: {client_num: 2, total_round_num: 1}\n")
    rc = _cli(["--cfg", str(base), "--space", str(space), "--method", "random", "--trials", "1",
                    "--outdir", str(tmp_path / "study")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and expected in err


def test_usage_errors_exit_2(tmp_path, capsys):
    space = _space(tmp_path, "train.optimizer.lr: {type: float, low: 0.1, high: 1.0}")
    base = tmp_path / "base.yaml"
    base.write_text("federate: {client_num: 2, total_round_num: 1}\n")
    for argv, expected in [
        (["--method", "random"], "needs a number of trials"),
        (["--method", "annealing"], "invalid choice"),
        (["--method", "grid", "--budget", "2.5"], "--budget: must be a positive int"),
        (["--method", "grid", "--budget-unit", "virtual_time"], "a virtual_time budget needs a value"),
    ]:
        rc = _cli(["--cfg", str(base), "--space", str(space), "--outdir", str(tmp_path / "s"), *argv])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and expected in err, (argv, err)
    base.write_text("federate: {client_numm: 2}\n")
    rc = _cli(["--cfg", str(base), "--space", str(space), "--method", "grid", "--outdir", str(tmp_path / "s")])
    assert rc == 2 and "federate.client_num" in capsys.readouterr().err
