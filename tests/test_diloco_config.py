"""DiLoCo's configuration: unsupported modes fail at config time with one line; allowed
but unfaithful combinations warn once."""
import logging
from pathlib import Path

import pytest

from fedcore.algorithms import diloco
from fedcore.kernel.errors import ConfigError
from fedcore.run import main
from tests.conftest import small_cfg

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
FAITHFUL = dict(algorithm__name="diloco", train__local_steps=3, train__optimizer__type="adamw",
                train__preserve_optimizer_state=True)


def load(**kw):
    keys = dict(FAITHFUL)
    keys.update(kw)
    return small_cfg(**{k: v for k, v in keys.items() if v is not None})


@pytest.fixture(autouse=True)
def _fresh_warnings():
    diloco.reset_warnings()
    yield
    diloco.reset_warnings()


def test_defaults_are_the_contract():
    cfg = load()
    assert cfg.section("algorithm.diloco") == {
        "outer_optimizer": "nesterov", "outer_learning_rate": 0.7, "outer_momentum": 0.9,
        "aggregation_weighting": "uniform", "apply_outer_optimizer_to": "parameters"}
    assert cfg["train.grad_accum_steps"] == 1 and cfg["train.scheduler.type"] == "none"


@pytest.mark.parametrize("overrides, key", [
    ({"train__local_steps": None}, "train.local_steps"),
    ({"train__preserve_optimizer_state": False}, "train.preserve_optimizer_state"),
    ({"data__splits": [0.0, 0.5, 0.5]}, "data.splits"),
    ({"algorithm__diloco__outer_learning_rate": 0.0}, "algorithm.diloco.outer_learning_rate"),
    ({"algorithm__diloco__outer_momentum": 1.0}, "algorithm.diloco.outer_momentum"),
    ({"algorithm__diloco__outer_optimizer": "adam"}, "algorithm.diloco.outer_optimizer"),
    ({"algorithm__diloco__aggregation_weighting": "loss"}, "algorithm.diloco.aggregation_weighting"),
    ({"algorithm__diloco__apply_outer_optimizer_to": "buffers"},
     "algorithm.diloco.apply_outer_optimizer_to"),
    ({"train__grad_accum_steps": 0}, "train.grad_accum_steps"),
    ({"train__scheduler__type": "cosine"}, "train.scheduler.total_steps"),
])
def test_unsupported_modes_fail_with_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load(**overrides)
    msg = str(err.value)
    assert key in msg and "\n" not in msg


def test_unsupported_mode_from_the_command_line_exits_2(tmp_path, capsys):
    code = main(["--cfg", str(SCENARIOS / "diloco_mlp.yaml"), "train.preserve_optimizer_state=false",
                 f"outdir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "train.preserve_optimizer_state" in err and "\n" not in err


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "fedcore.diloco"]


def test_faithful_config_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING):
        load()
    assert _warnings(caplog) == []


@pytest.mark.parametrize("overrides, word", [
    ({"train__optimizer__type": "sgd"}, "train.optimizer.type"),
    ({"algorithm__diloco__apply_outer_optimizer_to": "all_floating"}, "all_floating"),
    ({"federate__sample_client_num": 2}, "participation"),
    ({"federate__share_params": ["1.*"]}, "federate.share_params"),
])
def test_allowed_but_unfaithful_combinations_warn_once(caplog, overrides, word):
    with caplog.at_level(logging.WARNING):
        load(**overrides)
        load(**overrides)
    found = [m for m in _warnings(caplog) if word in m]
    assert len(found) == 1 and "not faithful" in found[0]


def test_other_algorithms_are_not_checked(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = small_cfg(train__optimizer__type="sgd")
    assert cfg["algorithm.name"] == "fedavg" and _warnings(caplog) == []
