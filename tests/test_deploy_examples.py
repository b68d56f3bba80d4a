"""The examples gallery's deployment across two machines (docs/examples/two_machines.py), run on
loopback: prepare, a TLS server with a tokens file, two clients each with its own token file."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "examples" / "two_machines.py"

pytestmark = [pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_example_runs_a_tls_course_on_loopback(tmp_path):
    pytest.importorskip("cryptography", reason="the certs extra (cryptography) makes the certificates")
    run = [sys.executable, str(SCRIPT)]
    prepared = subprocess.run(run + ["prepare", "--host", "localhost", "--clients", "2", "--dir", "sec"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    assert all((tmp_path / "sec" / f).stat().st_mode & 0o077 == 0 for f in ("tokens.yaml", "client1.token"))
    port, out = _free_port(), tmp_path / "out"
    common = ["--dir", "sec", "--port", str(port), "--clients", "2", "--rounds", "2"]
    server = subprocess.Popen(run + ["server", "--listen", "127.0.0.1", *common, f"outdir={out}", "verbose=false"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    clients = [subprocess.Popen(run + ["client", "--host", "localhost", "--id", str(k), *common, "verbose=false"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for k in (1, 2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in [server, *clients]]
    finally:
        for p in [server, *clients]:
            p.kill()
    assert [p.returncode for p in [server, *clients]] == [0, 0, 0], "\n".join(log[-2000:] for log in logs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2
    records = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_updates"] for r in records] == [2, 2]
    for k in (1, 2):   # no token on any command line: each came from its file
        token = (tmp_path / "sec" / f"client{k}.token").read_text().strip()
        assert token not in " ".join(clients[k - 1].args) and token not in "\n".join(logs)
