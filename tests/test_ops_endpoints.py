"""The operations port's answers without a course behind it (health from its stamps, the
operator token), its config checks, and `log_format: json`."""
from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from fedcore.deployment.ops_http import OpsServer
from fedcore.kernel.config import load_config
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.log_format import JsonFormatter, set_context

ROOT = Path(__file__).resolve().parents[1]


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def test_health_follows_the_loop_s_stamp_and_readiness_its_state_while_that_thread_is_stuck():
    beat = {"t": time.monotonic()}
    ready = {"ok": True}
    stuck = threading.Event()

    def alive():
        age = time.monotonic() - beat["t"]
        return age <= 0.5, {"loop_age_seconds": age}
    ops = OpsServer("127.0.0.1", 0, metrics=lambda: b"", alive=alive,
                    ready=lambda: (ready["ok"], {"listening": ready["ok"]}), token="op")
    try:
        assert _get(ops.port, "/healthz")[0] == 200 and _get(ops.port, "/readyz")[0] == 200
        # the course's thread stops turning (a handler that never returns): its stamp ages
        holder = threading.Thread(target=stuck.wait, args=(10,))
        holder.start()
        time.sleep(0.6)
        status, body = _get(ops.port, "/healthz")
        assert status == 503 and body["status"] == "unavailable" and body["loop_age_seconds"] > 0.5
        ready["ok"] = False
        assert _get(ops.port, "/readyz") == (503, {"status": "unavailable", "listening": False})
        stuck.set()
        holder.join()
        beat["t"] = time.monotonic()
        assert _get(ops.port, "/healthz")[0] == 200
        # the operator's token guards /metrics; probes need none
        assert _get(ops.port, "/metrics")[0] == 401
        assert _get(ops.port, "/metrics", {"Authorization": "Bearer op"})[0] == 200
        assert _get(ops.port, "/metrics", {"Authorization": "Basic op"})[0] == 401
        assert _get(ops.port, "/dashboard/", {"Authorization": "Bearer op"})[0] == 404   # not served here
    finally:
        ops.stop()


def test_a_busy_port_is_one_config_error():
    ops = OpsServer("127.0.0.1", 0, metrics=None, alive=lambda: (True, {}), ready=lambda: (True, {}))
    try:
        with pytest.raises(ConfigError, match=r"^distribute.metrics_port: cannot listen on 127.0.0.1:\d+"):
            OpsServer("127.0.0.1", ops.port, metrics=None, alive=lambda: (True, {}), ready=lambda: (True, {}))
    finally:
        ops.stop()


def test_the_dashboard_beyond_this_machine_needs_the_operator_token():
    base = {"distribute.role": "server", "distribute.insecure": True, "distribute.token": "t",
            "distribute.metrics_port": 9100, "distribute.dashboard": True}
    with pytest.raises(ConfigError, match="^distribute.dashboard: served on 0.0.0.0"):
        load_config(None, extra={**base, "distribute.metrics_host": "0.0.0.0"})
    load_config(None, extra={**base, "distribute.metrics_host": "0.0.0.0",
                             "distribute.operator_token_file": "/some/file"})
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        load_config(None, extra={**base, "distribute.metrics_host": host})


def test_json_lines_hold_the_text_line_s_fields_and_the_worker_and_round():
    record = logging.LogRecord("fedcore.deploy", logging.WARNING, __file__, 1, "client %d lost", (3,), None)
    record.created = 0.25
    set_context(lambda: {"worker": "server", "round": 7})
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        set_context(None)
    assert line == {"time": "1970-01-01T00:00:00.250+00:00", "level": "WARNING", "logger": "fedcore.deploy",
                    "message": "client 3 lost", "worker": "server", "round": 7}
    assert "worker" not in json.loads(JsonFormatter().format(record))


def test_log_format_json_on_the_command_line(tmp_path):
    # a config error is still one line on stderr; a warning logged during the run is one JSON object
    cfg = tmp_path / "c.yaml"
    cfg.write_text("federate: {client_num: 2, total_round_num: 1}\ndata: {type: synthetic}\n"
                   "privacy: {dp: {mode: central}}\nverbose: 0\n")
    from tests.deploy_helpers import run_fedcore   # forked from this test process's fork server
    r = run_fedcore(["--cfg", str(cfg), "log_format=json", f"outdir={tmp_path / 'out'}"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert lines and all(set(line) >= {"time", "level", "logger", "message"} for line in lines)
    assert any(line["logger"] == "fedcore.dp" and line["level"] == "WARNING" for line in lines)
    assert [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("{")] == []


def test_status_of_an_outdir_reads_its_files(tmp_path, capsys):
    import fedcore
    from fedcore.status import main
    from tests.conftest import small_cfg
    out = tmp_path / "run"
    fedcore.run(small_cfg(out, federate__total_round_num=3, checkpoint__every=1))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert main([str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"course       {out}  (finished: max_rounds)"
    assert lines[1] == "round        3 (3 recorded)"
    assert lines[2] == f"clients      {records[-1]['num_updates']} updates in the last round"
    assert lines[3] == f"test_acc     {records[-1]['test_acc']:.4g} (round 3)"
    assert lines[4].startswith("snapshot     round_3.pt, ") and lines[5] == "refused      0"
    assert main([str(tmp_path / "absent")]) == 2
    assert capsys.readouterr().err.startswith("fedcore.status: OUTDIR: ")
