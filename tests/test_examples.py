"""The examples gallery (docs/examples.md) runs as it says; the deployment across two machines is
tests/test_deploy_examples.py, the custom handler tests/test_tutorial_custom_handler.py, the
sweep tests/test_api.py, and the plug-ins module tests/test_guide_plugins.py."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_callback_example_stops_at_the_first_round_that_reaches_its_target(tmp_path, capsys):
    result = _module("target_callback").main(["--target", "0.6", "--outdir", str(tmp_path / "out")])
    evaluated = [(r["round"], r["test_acc"]) for r in result.records if r.get("test_acc") is not None]
    assert evaluated[-1][1] >= 0.6 and all(acc < 0.6 for _, acc in evaluated[:-1])
    assert result.records[-1]["round"] == evaluated[-1][0] < 60   # the quickstart's 60 rounds cut short
    written = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(written) == len(result.records)
    assert f"round {evaluated[-1][0]}: test_acc" in capsys.readouterr().out
