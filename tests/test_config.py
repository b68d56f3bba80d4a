"""Config: YAML + dotted overrides, schema defaults, and one-line errors with exit code 2."""
from pathlib import Path

import pytest

from fedcore.kernel.config import SCHEMA, load_config, parse_override
from fedcore.kernel.errors import ConfigError
from tests.deploy_helpers import run_fedcore


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_overrides_and_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, "federate:\n  client_num: 7\n"),
                      ["federate.total_round_num=3", "train.optimizer.lr=0.5", "data.splits=[0.6,0.2,0.2]"])
    assert cfg["federate.client_num"] == 7
    assert cfg.federate.total_round_num == 3
    assert cfg.train.optimizer.lr == 0.5
    assert cfg["data.splits"] == [0.6, 0.2, 0.2]
    assert cfg["train.batch_size"] == 32  # default filled in
    assert parse_override("asyn.x=true") == ("asyn.x", True)


@pytest.mark.parametrize("text, fragment", [
    ("federate:\n  client_nm: 5\n", "did you mean 'federate.client_num'"),
    ("federate:\n  client_num: five\n", "federate.client_num: expected int"),
    ("model:\n  dtype: float16\n", "model.dtype: 'float16' is not one of"),
    ("train:\n  optimizer:\n    lr: -1\n", "train.optimizer.lr: must be > 0, got -1"),
    ("algorithm:\n  name: fedavgg\n", "did you mean 'fedavg'"),
    ("seed: -1\n", "seed: must be in [0, 2**32 - 1], got -1"),
    ("name: a/b\n", "name: 'a/b' must be one folder name"),
    ("train:\n  optimizer: {type: adamw, momentum: 0.9}\n", "train.optimizer.momentum: 0.9 applies to sgd only"),
    ("seed: 4294967296\n", "seed: must be in [0, 2**32 - 1], got 4294967296"),
    ("federate:\n  client_num: 3\n  sample_client_num: 5\n", "exceeds federate.client_num"),
])
def test_bad_configs_raise_one_line_errors(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name, where", [
    ("hierfavg", "set topology.edges=K"),
    ("ditto", "set personalization.method=ditto"),
    ("fedbn", "set personalization.method=fedbn"),
    ("fedadam", "set server_optimizer.type=adam"),
    ("fedavgm", "set server_optimizer.type=sgdm"),
    ("krum", "set aggregator.robust_rule=krum"),
    ("secagg", "set secure_aggregation.enabled=true"),
    ("dp", "set privacy.dp.mode=central"),
])
def test_a_feature_reached_through_another_key_names_that_key(tmp_path, name, where):
    """`algorithm.name: ditto` is a natural first guess; the refusal says where the feature lives."""
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, f"algorithm:\n  name: {name}\n"))
    message = str(info.value)
    assert message.startswith(f"algorithm.name: '{name}' is reached through another key")
    assert where in message and "\n" not in message


def test_cli_feature_reached_through_another_key_exits_2_in_one_line(tmp_path, capsys):
    # fedcore.run's entry point in this process (the command itself: test_cli_typo_exits_2_with_suggestion)
    from fedcore.run import main
    code = main(["--cfg", str(_write(tmp_path, "{}\n")), "algorithm.name=hierfavg", "--check"])
    stderr = capsys.readouterr().err
    assert code == 2
    assert stderr.strip().count("\n") == 0 and "topology.edges" in stderr


def _cli(*args, cwd=None):
    return run_fedcore(args, cwd=cwd, timeout=120)


@pytest.mark.parametrize("override, fragment", [
    ("federate.client_nm=3", "unknown config key 'federate.client_nm' (did you mean 'federate.client_num'?)"),
    ("algorithm.name=fedavgg", "algorithm.name: 'fedavgg' is not one of"),
    ("algorithm.name=ditto", "set personalization.method=ditto"),
    ("model.dtype=float16", "model.dtype: 'float16' is not one of float32, float64"),
])
def test_a_typo_is_told_before_torch_is_imported(tmp_path, override, fragment):
    """The packaged key index judges names and words first: no plug-in, no torch."""
    import subprocess
    import sys
    base = _write(tmp_path, "defaults: [b.yaml]\nseed: 1\n")
    (tmp_path / "b.yaml").write_text("federate:\n  client_num: 4\n")
    code = ("import sys; from fedcore.run import main; rc = main(sys.argv[1:]); "
            "print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, "--cfg", str(base), override, "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert done.stderr.strip().count("\n") == 0 and fragment in done.stderr


def test_cli_typo_exits_2_with_suggestion(tmp_path):
    p = _write(tmp_path, "federate:\n  total_rounds: 5\n")
    r = _cli("--cfg", str(p))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "unknown config key 'federate.total_rounds'" in r.stderr
    assert "federate.total_round_num" in r.stderr


def test_cli_bad_override_value_and_missing_file_exit_2(tmp_path):
    p = _write(tmp_path, "{}\n")
    assert _cli("--cfg", str(p), "federate.client_num=abc").returncode == 2
    r = _cli("--cfg", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_cli_help_key():
    r = _cli("--help-key", "federate.total_round_num")
    assert r.returncode == 0
    assert "int" in r.stdout and "default 10" in r.stdout and "rounds" in r.stdout
    assert _cli("--help-key", "federate.total_rnd").returncode == 2


def test_cli_help_key_knows_the_keys_of_the_plugins_a_config_or_override_names(tmp_path):
    root = Path(__file__).resolve().parents[1]   # where `tests.slow_plugin` imports from
    r = _cli("--help-key", "slow_test.pause", "plugins=[tests.slow_plugin]", cwd=root)
    assert r.returncode == 0 and "slow_test.pause: float" in r.stdout, r.stderr
    base = _write(tmp_path, "plugins: [tests.slow_plugin]\n")
    (tmp_path / "mine.yaml").write_text(f"defaults: [{base.name}]\n")
    r = _cli("--cfg", str(tmp_path / "mine.yaml"), "--help-key", "slow_test", cwd=root)
    assert r.returncode == 0 and "slow_test.pause: float" in r.stdout, r.stderr
    assert _cli("--help-key", "slow_test.pause", cwd=root).returncode == 2   # named by nothing


def test_config_reference_in_docs_is_current():
    """Compared in a fresh process: tests register plug-ins of their own in this one."""
    from pathlib import Path
    doc = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    r = _cli("--list-keys")
    assert r.returncode == 0
    assert doc.read_text() == r.stdout, \
        "docs/config.md is stale: python -m fedcore.run --list-keys > docs/config.md"


def test_share_params_patterns_that_match_nothing_are_refused():
    import pytest
    from fedcore.runtime.course import Course
    from fedcore.kernel.errors import ConfigError
    from tests.conftest import small_cfg
    with pytest.raises(ConfigError, match="federate.share_params: pattern 'fc.weigth' matches no entry"):
        Course(small_cfg(federate__share_params=["fc.weigth"])).build()
    Course(small_cfg(federate__share_params=["*.weight"])).build()   # a pattern that matches is fine


@pytest.mark.parametrize("overrides, match", [
    (dict(model__type="mlp", model__hidden=[-3]), "model.hidden: \\[-3\\] must be a list of positive"),
    (dict(model__type="mlp", model__hidden=[0]), "model.hidden"),
    (dict(data__synthetic__dim=0), "data.synthetic.dim: must be > 0"),
    (dict(data__synthetic__num_classes=1), "data.synthetic.num_classes: must be >= 2"),
    (dict(model__lstm__hidden=0), "model.lstm.hidden: must be > 0"),
])
def test_sizes_that_torch_would_reject_deep_inside_are_config_errors(overrides, match):
    from fedcore.kernel.errors import ConfigError
    from tests.conftest import small_cfg
    with pytest.raises(ConfigError, match=match):
        small_cfg(**overrides)


def test_an_unusable_state_path_is_a_config_error(tmp_path):
    from fedcore.runtime.course import Course
    from fedcore.kernel.errors import ConfigError
    from tests.conftest import small_cfg
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="state.path: cannot use"):
        Course(small_cfg(state__store="disk", state__path=str(blocker / "sub"))).build()


def test_malformed_yaml_is_one_line_with_its_place(tmp_path):
    from fedcore.kernel.config import load_config
    from fedcore.kernel.errors import ConfigError
    p = _write(tmp_path, "federate: {client_num: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    message = str(info.value)
    assert "\n" not in message and "is not valid YAML" in message and "line 2" in message


def test_a_key_with_sub_keys_takes_a_scalar_or_a_mapping(tmp_path):
    """`executor: vectorized` as ever, or `executor: {name: ..., ray: {...}}` with its sub-keys;
    the dumped config.yaml loads back to the same values."""
    plain = tmp_path / "plain.yaml"
    plain.write_text("executor: vectorized\nexecutor.ray:\n  num_cpus: 2\n")
    cfg = load_config(plain, ["executor.ray.num_gpus=0.25"])
    assert cfg["executor"] == "vectorized" and cfg["executor.ray.num_cpus"] == 2.0
    assert cfg["executor.ray.num_gpus"] == 0.25
    nested = tmp_path / "nested.yaml"
    nested.write_text("executor:\n  name: processes\n  ray:\n    address: auto\n")
    cfg = load_config(nested)
    assert cfg["executor"] == "processes" and cfg["executor.ray.address"] == "auto"
    cfg = load_config(nested, ["executor={name: sequential, ray: {num_cpus: 3}}"])
    assert cfg["executor"] == "sequential" and cfg["executor.ray.num_cpus"] == 3.0
    cfg.dump(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert {k: again[k] for k in SCHEMA} == {k: cfg[k] for k in SCHEMA}
    nested.write_text("executor:\n  name: processes\n  ray:\n    num_cpu: 2\n")
    with pytest.raises(ConfigError, match="executor.ray.num_cpus"):
        load_config(nested)


def test_a_directory_given_as_the_config_file_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=f"'{tmp_path}' is a directory, not a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="file '.*nothere.yaml' does not exist"):
        load_config(tmp_path / "nothere.yaml")
