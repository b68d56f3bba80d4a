"""A deployed course under the operator's HMAC key, its newest snapshot altered on disk.

Real processes on loopback. The attacker can write the server's checkpoint folder but not
read the key: they flip one byte of the newest snapshot (round 2). The server restarted with
resume_from=latest refuses it in one line, resumes from round 1's (its record of round 1
is the simulation's) and runs rounds 2 to 4; the clients keep their states tagged under
their key, 0600 in 0700 folders. (The deployed clients start with fresh client state, so
the final model is not the simulation's; that a tagged snapshot resumes bit-identically is
tests/test_snapshot_tamper.py's.)
"""
import json
import os
import shutil
import stat

import pytest
import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from tests.deploy_helpers import server_port, text, wait_exit, write_cfg

pytestmark = pytest.mark.slow

ROUNDS = 4


def test_a_resumed_server_skips_an_altered_snapshot_and_ends_as_the_uninterrupted_course(tmp_path, procs):
    key = tmp_path / "hmac.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 3, "federate.total_round_num": ROUNDS, "eval.clients": False,
        "algorithm.name": "scaffold", "checkpoint.hmac_key_file": str(key),
        "distribute.insecure": True, "distribute.token": "t", "distribute.round_deadline": 120.0,
        "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 20.0,
        "distribute.backoff_initial": 0.1, "distribute.backoff_max": 0.5})
    sim = tmp_path / "simulated"
    Course(load_config([str(cfg)], ["federate.mode=standalone", f"outdir={sim}", "checkpoint.every=1"])).run()

    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    for k in (1, 2):
        shutil.copy(sim / "checkpoints" / f"round_{k}.pt", out / "checkpoints" / f"round_{k}.pt")
    newest = out / "checkpoints" / "round_2.pt"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    newest.write_bytes(bytes(raw))

    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}", "resume_from=latest")
    port = server_port(out, server)
    for k in (1, 2, 3):
        procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                      f"distribute.client_id={k}", f"outdir={tmp_path / f'client{k}'}")
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    log = text(server)
    refused = [line for line in log.splitlines() if "using the snapshot before it" in line]
    assert len(refused) == 1 and "round_2.pt" in refused[0] and "fails its HMAC check" in refused[0], log[-3000:]
    assert "resuming the course from the snapshot of round 1" in log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    simulated = [json.loads(line) for line in (sim / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    assert records[0] == simulated[0]            # round 1's record, from round 1's snapshot
    final = torch.load(out / "final_model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in final.values())
    assert key.read_bytes().hex() not in log
    for k in (1, 2, 3):
        folder = tmp_path / f"client{k}" / "client_state" / str(k)
        files = sorted(folder.glob("round_*.state"))
        assert files and all(f.read_bytes().startswith(b"FCTAG1 ") for f in files), k
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "final_model.pt").stat().st_mode) == 0o600
