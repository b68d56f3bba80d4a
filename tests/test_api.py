"""The Python API: fedcore.run returns what the run wrote, from files, dicts and overrides."""
import json

import pytest
import torch

import fedcore
from fedcore.api import RunResult
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.monitor import Callback

SMALL = {"seed": 0, "verbose": False,
         "federate": {"client_num": 6, "total_round_num": 3},
         "data": {"type": "synthetic", "partition": "natural",
                  "synthetic": {"samples_per_client": 30, "dim": 8, "num_classes": 3}},
         "train": {"batch_size": 10, "optimizer": {"lr": 0.1}}}


def test_the_summary_counts_the_models_parameters_and_a_run_reads_back_from_fedcore_api(tmp_path):
    # the contract's summary fields for every course: SMALL's model is one Linear 8 -> 3,
    # 8 x 3 weights and 3 biases, all trained; then, in a fresh interpreter, `import fedcore`
    # alone gives fedcore.api.RunResult.load (the docs' way to read a run back)
    import subprocess
    import sys
    result = fedcore.run(SMALL, outdir=str(tmp_path / "a"))
    assert result.summary["trainable_params"] == result.summary["total_params"] == 8 * 3 + 3
    read = subprocess.run([sys.executable, "-c", "import sys, fedcore; r = fedcore.api.RunResult.load(sys.argv[1]); "
                           "print(r.summary['total_params'])", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=120)
    assert read.returncode == 0 and read.stdout.strip() == "27", read.stderr[-2000:]


def test_a_simulation_refuses_an_outdir_holding_another_runs_records(tmp_path):
    # the first run's records and final model survive a second run into the same folder;
    # outdir_overwrite=true replaces them, and an empty metrics file is no record to keep
    first = fedcore.run(SMALL, outdir=str(tmp_path / "a"))
    kept = (tmp_path / "a" / "metrics.jsonl").read_bytes()
    model = (tmp_path / "a" / "final_model.pt").read_bytes()
    with pytest.raises(ConfigError, match="holds another run's records.*outdir_overwrite=true"):
        fedcore.run(SMALL, outdir=str(tmp_path / "a"), federate__total_round_num=1)
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == kept
    assert (tmp_path / "a" / "final_model.pt").read_bytes() == model
    again = fedcore.run(SMALL, outdir=str(tmp_path / "a"), federate__total_round_num=1, outdir_overwrite=True)
    assert len(first.records) == 3 and len(again.records) == 1
    assert len((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_simulation_rerun_by_the_cli_into_its_outdir_exits_2_in_one_line(tmp_path):
    from tests.deploy_helpers import run_fedcore
    cfg = tmp_path / "c.yaml"
    import yaml
    cfg.write_text(yaml.safe_dump({**SMALL, "federate": {"client_num": 6, "total_round_num": 1}}))
    out = tmp_path / "run"
    assert run_fedcore(["--cfg", str(cfg), f"outdir={out}"], timeout=300).returncode == 0
    again = run_fedcore(["--cfg", str(cfg), f"outdir={out}"], timeout=300)
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0 and "holds another run's records" in again.stderr


def test_result_holds_what_the_run_wrote(tmp_path):
    result = fedcore.run(SMALL, outdir=str(tmp_path / "a"), train__optimizer__lr=0.2)
    assert result.outdir == tmp_path / "a"
    assert result.config["train.optimizer.lr"] == 0.2
    assert result.config.source("train.optimizer.lr") == "fedcore.run() arguments"
    written = [json.loads(line) for line in (result.outdir / "metrics.jsonl").read_text().splitlines()]
    assert result.records == written and [r["round"] for r in written] == [1, 2, 3]
    assert result.summary == json.loads((result.outdir / "summary.json").read_text())
    saved = torch.load(result.outdir / "final_model.pt", weights_only=True)
    assert saved.keys() == result.final_model.keys()
    assert all(torch.equal(saved[k], result.final_model[k]) for k in saved)
    xs, ys = result.curve("test_acc")
    assert xs == [1, 2, 3] and ys == [r["test_acc"] for r in written]
    with pytest.raises(KeyError, match="no record has 'test_accuracy'; the records have .*test_acc"):
        result.curve("test_accuracy")
    loaded = RunResult.load(result.outdir)
    assert loaded.records == result.records and loaded.summary == result.summary


def test_same_config_same_records_from_a_file_and_from_a_dict(tmp_path):
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    a = fedcore.run(str(path), outdir=str(tmp_path / "a"))
    b = fedcore.run(SMALL, outdir=str(tmp_path / "b"))
    strip = [{k: v for k, v in r.items() if k != "wall_time"} for r in a.records]
    assert strip == [{k: v for k, v in r.items() if k != "wall_time"} for r in b.records]


def test_run_still_callable_after_the_cli_module_is_imported(tmp_path):
    import fedcore.run as cli
    assert callable(cli.main)
    result = fedcore.run([SMALL, {"federate.total_round_num": 1}], outdir=str(tmp_path))
    assert result.summary["rounds"] == 1


def test_callbacks_see_every_record_in_order_and_the_summary(tmp_path):
    seen = []

    class Spy(Callback):
        def on_start(self, monitor):
            seen.append("start")

        def on_record(self, record):
            seen.append(record["round"])

        def on_end(self, summary):
            seen.append(("end", summary["rounds"]))

    fedcore.run(SMALL, outdir=str(tmp_path), callbacks=[Spy()])
    assert seen == ["start", 1, 2, 3, ("end", 3)]


def test_bad_keys_raise_config_errors():
    with pytest.raises(ConfigError, match="did you mean 'federate.client_num'"):
        fedcore.configure(SMALL, federate__client_nums=3)
    with pytest.raises(ConfigError, match="fedcore.run\\(\\) simulates"):
        fedcore.run(SMALL, federate__mode="distributed", distribute__role="server",
                    distribute__insecure=True)


@pytest.mark.extra("plot")
def test_the_sweep_example_runs_and_plots(tmp_path):
    import runpy
    from pathlib import Path
    example = Path(__file__).resolve().parent.parent / "docs" / "examples" / "sweep_lr.py"
    sweep = runpy.run_path(str(example))["sweep"]
    results, figure = sweep(lrs=(0.05, 0.5), rounds=3, outdir=tmp_path)
    assert figure.is_file() and figure.stat().st_size > 0
    assert [r.config["train.optimizer.lr"] for r in results] == [0.05, 0.5]
    assert all(r.summary["rounds"] == 3 for r in results)


def test_a_missing_config_file_is_named_without_the_command_lines_flag():
    with pytest.raises(ConfigError, match="^config: file 'nope.yaml' does not exist$"):
        fedcore.run("nope.yaml")
