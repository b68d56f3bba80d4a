"""Ctrl-C in a simulation keeps its summary (stopped_by: interrupted) and the last aggregated model."""
import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from fedcore.course import Course
from fedcore.monitor import Callback
from tests.conftest import small_cfg
from tests.deploy_helpers import ROOT, _env, wait_for


class CtrlCAfter(Callback):
    """Raises KeyboardInterrupt as the given round's record is written, as Ctrl-C would."""

    def __init__(self, round_):
        self.round = round_

    def on_record(self, record):
        if record["round"] == self.round:
            raise KeyboardInterrupt


def test_interrupt_writes_summary_and_the_last_aggregated_model(tmp_path):
    cfg = small_cfg(tmp_path / "cut", federate__total_round_num=5, eval__clients=False)
    with pytest.raises(KeyboardInterrupt):
        Course(cfg, callbacks=[CtrlCAfter(2)]).run()
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted" and summary["rounds"] == 2
    cut = torch.load(tmp_path / "cut" / "final_model.pt", weights_only=True)
    # the same course run for exactly two rounds ends with the same model
    two = Course(small_cfg(tmp_path / "two", federate__total_round_num=2, eval__clients=False)).run()
    assert two["stopped_by"] == "max_rounds"
    full = torch.load(tmp_path / "two" / "final_model.pt", weights_only=True)
    assert cut.keys() == full.keys() and all(torch.equal(cut[k], full[k]) for k in cut)


@pytest.mark.slow
def test_sigint_to_the_cli_exits_130_with_outputs(tmp_path):
    cfg = tmp_path / "long.yaml"
    cfg.write_text("federate: {client_num: 20, total_round_num: 100000}\n"
                   "data: {synthetic: {samples_per_client: 50}}\neval: {clients: false}\n")
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "fedcore.run", "--cfg", str(cfg), f"outdir={out}"],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, 120,
                 "two rounds")
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "fedcore: interrupted"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted" and summary["rounds"] >= 2
    assert summary["rounds"] == len(metrics.read_text().splitlines())
    assert torch.load(out / "final_model.pt", weights_only=True)


def test_a_callback_can_stop_the_course_and_keep_its_outputs(tmp_path):
    from fedcore.monitor import StopRun

    class Prune(Callback):
        def on_record(self, record):
            if record["round"] == 2:
                raise StopRun("pruned")

    summary = Course(small_cfg(tmp_path, federate__total_round_num=5), callbacks=[Prune()]).run()
    assert summary["stopped_by"] == "pruned" and summary["rounds"] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_by"] == "pruned"
    assert (tmp_path / "final_model.pt").is_file()
