"""Config composition: `defaults:` files, several --cfg, overrides; and where each value came from."""
import pytest
import yaml

from fedcore.kernel.config import load_config
from fedcore.kernel.errors import ConfigError
from fedcore.run import main


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tree(tmp_path):
    write(tmp_path / "bases" / "task.yaml",
          "seed: 1\nfederate: {client_num: 8, total_round_num: 4}\n"
          "train: {optimizer: {lr: 0.5, momentum: 0.9}, batch_size: 16}\n")
    write(tmp_path / "bases" / "devices.yaml", "seed: 2\ntime: {profiles: {type: random}}\n")
    return write(tmp_path / "exp.yaml", "defaults: [bases/task.yaml, bases/devices.yaml]\n"
                                        "name: exp\ntrain: {optimizer: {lr: 0.1}}\n")


def test_precedence_defaults_then_file_then_later_cfg_then_overrides(tree, tmp_path):
    cfg = load_config(tree)
    assert cfg["seed"] == 2                               # the later default wins over the earlier
    assert cfg["train.optimizer.lr"] == 0.1               # the file wins over its defaults
    assert cfg["train.optimizer.momentum"] == 0.9         # sections merge key by key
    assert cfg["federate.client_num"] == 8
    later = write(tmp_path / "later.yaml", "federate: {total_round_num: 9}\ntrain: {batch_size: 8}\n")
    cfg = load_config([tree, later], ["train.batch_size=4"])
    assert cfg["federate.total_round_num"] == 9 and cfg["federate.client_num"] == 8
    assert cfg["train.batch_size"] == 4
    assert cfg.source("seed") == str(tmp_path / "bases" / "devices.yaml")
    assert cfg.source("train.optimizer.lr") == str(tree)
    assert cfg.source("train.optimizer.momentum") == str(tmp_path / "bases" / "task.yaml")
    assert cfg.source("federate.total_round_num") == str(later)
    assert cfg.source("train.batch_size") == "command line"
    assert cfg.source("eval.freq") == "default"


def test_mappings_compose_like_files(tree):
    cfg = load_config([tree, {"train": {"optimizer": {"lr": 0.3}}, "federate.client_num": 5}])
    assert (cfg["train.optimizer.lr"], cfg["federate.client_num"]) == (0.3, 5)
    assert cfg["train.optimizer.momentum"] == 0.9 and cfg.source("federate.client_num") == "arguments"


def test_cli_merges_several_cfg_and_records_sources(tree, tmp_path, capsys):
    later = write(tmp_path / "later.yaml", "federate: {total_round_num: 2}\n")
    out = tmp_path / "out"
    assert main(["--cfg", str(tree), "--cfg", str(later), "--check", f"outdir={out}"]) == 0
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["federate"]["total_round_num"] == 2 and resolved["train"]["optimizer"]["lr"] == 0.1
    sources = yaml.safe_load((out / "config_sources.yaml").read_text())
    assert sources["federate.total_round_num"] == str(later)
    assert sources["seed"] == str(tmp_path / "bases" / "devices.yaml")
    assert sources["outdir"] == "command line" and "eval.freq" not in sources


def test_bad_defaults_are_one_line_errors(tmp_path):
    a = write(tmp_path / "a.yaml", "defaults: [b.yaml]\nseed: 1\n")
    write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="defaults: '.*a.yaml' includes itself"):
        load_config(a)
    missing = write(tmp_path / "m.yaml", "defaults: [nope.yaml]\n")
    with pytest.raises(ConfigError, match="^defaults of '.*m.yaml': file '.*nope.yaml' does not exist$"):
        load_config(missing)
    bad = write(tmp_path / "bad.yaml", "defaults: 3\n")
    with pytest.raises(ConfigError, match="defaults: in .*bad.yaml: expected a list"):
        load_config(bad)
    typo = write(tmp_path / "t.yaml", "defaults: [c.yaml]\n")
    write(tmp_path / "c.yaml", "federate: {client_nums: 3}\n")
    with pytest.raises(ConfigError, match="did you mean 'federate.client_num'"):
        load_config(typo)


def test_empty_file_is_refused_but_an_empty_mapping_runs_defaults(tmp_path):
    with pytest.raises(ConfigError, match="is empty"):
        load_config(write(tmp_path / "e.yaml", "# nothing\n"))
    assert load_config(write(tmp_path / "d.yaml", "{}\n"))["federate.client_num"] == 100


def test_the_async_vs_sync_family_shares_one_base():
    from pathlib import Path
    scenarios = Path(__file__).resolve().parent.parent / "scenarios"
    base = scenarios / "base" / "async_vs_sync_setting.yaml"
    for member in sorted(scenarios.glob("async_vs_sync*.yaml")):
        cfg = load_config(member)
        assert cfg.source("federate.client_num") == str(base), member.name
        assert cfg.source("name") == str(member)
        assert len(member.read_text().splitlines()) < 16   # no repeated setting left
