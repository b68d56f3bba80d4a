"""Loggers write the same records as metrics.jsonl; each tool's own reader reads them back."""
import csv
import json
import math
import struct

import pytest

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from tests.conftest import need_extra, small_cfg
from tests.deploy_helpers import wait_for


def records(outdir):
    return [json.loads(line) for line in (outdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """One small course with csv, tensorboard and mlflow on (eval every 2 rounds: fields vary)."""
    need_extra("tensorboard")
    need_extra("mlflow")
    out = tmp_path_factory.mktemp("logged")
    cfg = small_cfg(out, name="logged", federate__total_round_num=3, eval__freq=2,
                    loggers=["csv", "tensorboard", "mlflow"])
    Course(cfg).run()
    return out


def test_csv_rows_are_the_records(logged):
    with (logged / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    recs = records(logged)
    assert len(rows) == len(recs) == 3
    assert set(rows[0]) == set().union(*recs)          # the header grew to every field
    for row, rec in zip(rows, recs):
        for key, value in rec.items():
            assert float(row[key]) == pytest.approx(value, rel=1e-15)
        assert all(row[k] == "" for k in set(row) - set(rec))   # round 1 has no test_acc


def test_tensorboard_events_read_back(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logged / "tensorboard"))
    acc.Reload()
    recs = records(logged)
    for tag in ("test_acc", "bytes_total", "virtual_time"):
        events = acc.Scalars(tag)
        expected = [(r["round"], r[tag]) for r in recs if tag in r]
        assert [e.step for e in events] == [s for s, _ in expected]
        assert [e.value for e in events] == pytest.approx([v for _, v in expected], rel=1e-6)  # float32


def test_mlflow_file_store_reads_back(logged):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=(logged / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("logged")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.optimizer.lr"] == "0.1" and run.data.params["federate.client_num"] == "6"
    recs = records(logged)
    for key in ("test_acc", "bytes_up_total"):
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(r["round"], r[key]) for r in recs if key in r]


def _wandb_records(path):
    """Records of a W&B transaction log (a LevelDB-style log: 7-byte file header, then
    32 KiB blocks of chunks with a 7-byte header: crc32, length, type 1 full/2 first/3 middle/4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            return   # a chunk still being written
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield pending
            pending = b""


@pytest.mark.slow
@pytest.mark.extra("wandb")
def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    from wandb.proto import wandb_internal_pb2
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    Course(small_cfg(tmp_path, name="wb", federate__total_round_num=3, loggers=["wandb"])).run()
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")

    def complete_log():
        """The log's records once its exit record is there (wandb's writer process may still
        be flushing when finish() returns), else None."""
        recs = []
        for raw in _wandb_records(log):
            recs.append(wandb_internal_pb2.Record())
            recs[-1].ParseFromString(raw)
        return recs if any(r.WhichOneof("record_type") == "exit" for r in recs) else None
    logged = wait_for(complete_log, 60, "the W&B log's exit record", interval=0.2)
    history, config = [], None
    for rec in logged:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or ".".join(i.nested_key)): json.loads(i.value_json)
                            for i in rec.history.item})
        elif kind == "run":
            config = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json)
                      for i in rec.run.config.update}
    recs = records(tmp_path)
    assert [h["_step"] for h in history] == [r["round"] for r in recs]
    for h, r in zip(history, recs):
        assert all(math.isclose(h[k], v, rel_tol=1e-12) for k, v in r.items() if k != "round")
    assert config["federate"]["client_num"] == 6


def test_missing_package_and_unknown_logger_are_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="loggers: unknown logger 'neptune'; known: csv"):
        small_cfg(tmp_path, loggers=["neptune"])
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    with pytest.raises(ConfigError, match="loggers: mlflow needs the 'mlflow' package: "
                                          'pip install "fedcore\\[mlflow\\]"'):
        Course(small_cfg(tmp_path, loggers=["mlflow"]))
    with pytest.raises(ConfigError, match="loggers: csv writes into the run's folder; set outdir"):
        Course(small_cfg(None, loggers=["csv"])).run()
