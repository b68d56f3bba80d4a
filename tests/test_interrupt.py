"""Ctrl-C in a simulation keeps its summary (stopped_by: interrupted) and the last aggregated model;
a first Ctrl-C or SIGTERM also lets the round end and snapshots it, and the printed command resumes."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.monitor import Callback
from tests.conftest import small_cfg
from tests.deploy_helpers import ROOT, _env, _fork_server, run_fedcore, wait_for


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


def _sigint_after(cfg, out, rounds: int, settle: float = 0.0) -> str:
    """Run `python -m fedcore.run` on `cfg`, SIGINT it once `rounds` records are written; its
    stderr, after checking that it exited 130. The process is forked from the test process's
    fork server where there is one (as `run_fedcore` starts it: Python's SIGINT handler, as a
    terminal's fresh process has, without three seconds of imports)."""
    args = ["--cfg", str(cfg), f"outdir={out}"]
    with tempfile.TemporaryFile() as err_file, open(os.devnull, "rb") as null:
        server = _fork_server()
        if server is None:
            p = subprocess.Popen([sys.executable, "-m", "fedcore.run", *args], cwd=ROOT, env=_env(),
                                 stdout=subprocess.DEVNULL, stderr=err_file)
        else:
            p = server.spawn(args, _env(), str(ROOT), (null.fileno(), null.fileno(), err_file.fileno()))
        try:
            metrics = out / "metrics.jsonl"
            wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= rounds, 120,
                     f"{rounds} rounds")
            time.sleep(settle)
            p.send_signal(signal.SIGINT)
            p.wait(60)
        finally:
            if p.poll() is None:
                p.kill()
        err_file.seek(0)
        err = err_file.read().decode(errors="replace")
    assert p.returncode == 130, err
    return err


@pytest.mark.slow
def test_sigint_to_the_cli_exits_130_with_outputs(tmp_path):
    cfg = tmp_path / "long.yaml"
    cfg.write_text("federate: {client_num: 20, total_round_num: 100000}\n"
                   "data: {synthetic: {samples_per_client: 50}}\neval: {clients: false}\n")
    out = tmp_path / "out"
    metrics = out / "metrics.jsonl"
    err = _sigint_after(cfg, out, rounds=2, settle=0.2)
    assert err.strip().splitlines()[-1] == "fedcore: interrupted"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted" and summary["rounds"] >= 2
    assert summary["rounds"] == len(metrics.read_text().splitlines())
    assert torch.load(out / "final_model.pt", weights_only=True)


def test_a_callback_can_stop_the_course_and_keep_its_outputs(tmp_path):
    from fedcore.runtime.monitor import StopRun

    class Prune(Callback):
        def on_record(self, record):
            if record["round"] == 2:
                raise StopRun("pruned")

    summary = Course(small_cfg(tmp_path, federate__total_round_num=5), callbacks=[Prune()]).run()
    assert summary["stopped_by"] == "pruned" and summary["rounds"] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_by"] == "pruned"
    assert (tmp_path / "final_model.pt").is_file()


class SignalAt(Callback):
    """Sends this process `signals` as the given round's record is written, as Ctrl-C would."""

    def __init__(self, round_, signals):
        self.round, self.signals = round_, signals

    def on_record(self, record):
        if record["round"] == self.round:
            for sig in self.signals:
                os.kill(os.getpid(), sig)


def _model(path):
    return torch.load(path / "final_model.pt", weights_only=True)


def _same_model(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_round_snapshots_it_and_the_snapshot_resumes_exactly(tmp_path, sig):
    common = dict(federate__total_round_num=5, federate__sample_client_num=3,
                  train__optimizer__momentum=0.9, train__preserve_optimizer_state=True)
    cut = tmp_path / "cut"
    course = Course(small_cfg(cut, **common), callbacks=[SignalAt(2, [sig])])
    with pytest.raises(KeyboardInterrupt):
        course.run()
    # the course stops once the round in progress is aggregated (round 2's record waits for its
    # clients' evaluations, which come back in round 3), with that round's snapshot although
    # checkpoint.every is 0, and the outputs end at that round
    summary = json.loads((cut / "summary.json").read_text())
    reached = course.checkpointer.last_round
    assert summary["stopped_by"] == "interrupted" and summary["rounds"] == reached and 2 <= reached < 5
    snapshot = cut / "checkpoints" / f"round_{reached}.pt"
    assert course.checkpointer.last_path == snapshot and snapshot.is_file()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers put back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    Course(small_cfg(cut, resume_from=str(snapshot), **common)).run()
    Course(small_cfg(tmp_path / "full", **common)).run()
    assert _same_model(_model(cut), _model(tmp_path / "full"))
    rounds = [json.loads(x)["round"] for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3, 4, 5]


def test_a_second_interrupt_stops_at_once_without_a_snapshot(tmp_path):
    course = Course(small_cfg(tmp_path, federate__total_round_num=5, eval__clients=False),
                    callbacks=[SignalAt(2, [signal.SIGINT, signal.SIGINT])])
    with pytest.raises(KeyboardInterrupt):
        course.run()
    assert course.checkpointer.last_path is None and not (tmp_path / "checkpoints").exists()
    assert json.loads((tmp_path / "summary.json").read_text())["rounds"] == 2


def test_resume_from_a_final_model_names_the_snapshot_to_use(tmp_path):
    Course(small_cfg(tmp_path / "plain", federate__total_round_num=3)).run()
    final = tmp_path / "plain" / "final_model.pt"
    with pytest.raises(ConfigError) as no_snapshot:
        Course(small_cfg(tmp_path / "again", federate__total_round_num=3, resume_from=str(final))).build()
    assert str(no_snapshot.value) == (
        f"resume_from: '{final}' is not a fedcore checkpoint but a model's weights only; that run left "
        f"no snapshot in {tmp_path / 'plain' / 'checkpoints'} (written every checkpoint.every rounds, "
        f"and on Ctrl-C); to start a new course from these weights use model.init_from={final}")

    Course(small_cfg(tmp_path / "saved", federate__total_round_num=4, checkpoint__every=1)).run()
    final = tmp_path / "saved" / "final_model.pt"
    with pytest.raises(ConfigError) as snapshots:
        Course(small_cfg(tmp_path / "again", federate__total_round_num=6, resume_from=str(final))).build()
    newest = tmp_path / "saved" / "checkpoints" / "round_4.pt"   # of rounds 1..4, not 'round_10' sorting
    assert str(snapshots.value).endswith(f"resume from its newest snapshot, resume_from={newest}")


@pytest.mark.slow
def test_ctrl_c_then_the_printed_command_finishes_the_course_as_if_uninterrupted(tmp_path):
    """The default config (checkpoint.every: 0) with clients that pause 50 ms before training,
    so that the interrupt lands mid-course."""
    cfg = tmp_path / "course.yaml"
    cfg.write_text("plugins: [tests.slow_plugin]\nalgorithm: {name: fedavg_pausing}\n"
                   "slow_test: {pause: 0.05}\nfederate: {client_num: 4, total_round_num: 12}\n"
                   "data: {synthetic: {samples_per_client: 30}}\n")
    full = tmp_path / "full"
    done = run_fedcore(["--cfg", cfg, f"outdir={full}"], env=_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr

    out = tmp_path / "out"
    metrics = out / "metrics.jsonl"
    lines = _sigint_after(cfg, out, rounds=3).strip().splitlines()
    assert lines[-1] == "fedcore: interrupted"
    reached = json.loads((out / "summary.json").read_text())["rounds"]
    assert 3 <= reached < 12
    assert lines[-3] == f"fedcore: stopped after round {reached}; outputs in {out}"
    prefix = f"fedcore: resume from the snapshot of round {reached} with: "
    assert lines[-2].startswith(prefix) and (out / "checkpoints" / f"round_{reached}.pt").is_file()

    resumed = subprocess.run(["bash", "-c", lines[-2][len(prefix):]], env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert _same_model(_model(out), _model(full))
    rounds = [json.loads(x)["round"] for x in metrics.read_text().splitlines()]
    assert rounds == list(range(1, 13))


class CtrlCToTheGroup(Callback):
    """At the given round's record: SIGINT to this process and its forked workers, as a
    terminal's Ctrl-C sends it to the whole foreground process group."""

    def __init__(self, round_):
        self.round = round_

    def on_record(self, record):
        import multiprocessing
        if record["round"] == self.round:
            workers = multiprocessing.active_children()
            assert workers  # the pool is running
            for w in workers:
                os.kill(w.pid, signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)


def test_forked_workers_leave_the_interrupt_to_the_course(tmp_path, capfd):
    common = dict(federate__total_round_num=4, eval__clients=False, executor="processes",
                  executor_workers=2, torch_threads=1)
    course = Course(small_cfg(tmp_path / "cut", **common), callbacks=[CtrlCToTheGroup(2)])
    with pytest.raises(KeyboardInterrupt):
        course.run()
    snapshot = course.checkpointer.last_path
    assert course.checkpointer.last_round == 2 and snapshot.is_file()  # record 2 precedes its snapshot
    err = capfd.readouterr().err
    assert err.count("fedcore: stopping when") == err.count("stopping when round 2 ends") == 1  # once, not per worker
    Course(small_cfg(tmp_path / "cut", resume_from=str(snapshot), **common)).run()
    Course(small_cfg(tmp_path / "full", **common)).run()
    assert _same_model(_model(tmp_path / "cut"), _model(tmp_path / "full"))


def test_a_forked_worker_still_ends_on_sigterm(tmp_path):
    """`terminate()` (SIGTERM) is how a pool ends a worker that does not stop: the handler a
    forked worker inherits from the course must not make it immortal."""
    import multiprocessing

    class Terminate(Callback):
        def on_record(self, record):
            if record["round"] == 1:
                [worker, *_] = multiprocessing.active_children()
                worker.terminate()
                worker.join(10)
                self.exitcode = worker.exitcode

    seen = Terminate()
    Course(small_cfg(tmp_path, federate__total_round_num=2, eval__clients=False, executor="processes",
                     executor_workers=2, torch_threads=1), callbacks=[seen]).run()
    assert seen.exitcode == -signal.SIGTERM
