"""Honest clients that missed rounds, between real processes: one joins a running course late,
one is paused (SIGSTOP) for longer than the heartbeat timeout and resumed. Each is compared with
what it could honestly send after the rounds it missed (fedcore/admission.py `History`), so its
next update is admitted; the course's model had moved away from its data meanwhile, and
10 x the median of the others alone refuses such an update."""
import json
import os
import signal
import time

import pytest

from tests.deploy_helpers import interrupt, server_port, text, wait_exit, wait_for, write_cfg

pytestmark = pytest.mark.slow

JOIN_AT = int(os.environ.get("FEDCORE_TEST_JOIN_AT", "150"))


def _records(out):
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def test_a_late_joiner_and_a_paused_client_have_their_next_honest_update_admitted(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 5, "federate.total_round_num": 100_000, "eval.freq": 100_000,
        "eval.clients": False, "distribute.min_clients": 4, "distribute.join_timeout": 0.5,
        "distribute.insecure": True, "distribute.token": "t",
        "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 2.0,
        "distribute.backoff_initial": 0.1, "distribute.backoff_max": 0.5})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)

    def client(k):
        return procs.fedcore(f"client{k}", cfg, "distribute.role=client",
                             f"distribute.server_port={port}", f"distribute.client_id={k}")
    clients = {k: client(k) for k in (1, 2, 3, 4)}

    def rounds_with_all_five(after):
        return [r for r in _records(out)[after:] if r["num_updates"] == 5]

    # Client 5 joins once the course has run JOIN_AT rounds without its data.
    wait_for(lambda: len(_records(out)) >= JOIN_AT, 300, f"{JOIN_AT} rounds")
    clients[5] = client(5)
    wait_for(lambda: "client 5 joined the course" in text(server), 120, "client 5 to join")
    joined = len(_records(out))
    wait_for(lambda: rounds_with_all_five(joined), 60, "a round with client 5's update")

    # Client 3 stops for longer than the heartbeat timeout; the course goes on without it.
    clients[3].send_signal(signal.SIGSTOP)
    wait_for(lambda: "client 3 lost" in text(server), 60, "the server to lose client 3")
    time.sleep(2.0)
    clients[3].send_signal(signal.SIGCONT)
    resumed = len(_records(out))
    wait_for(lambda: rounds_with_all_five(resumed), 60, "a round with client 3's update again")

    interrupt(server)
    assert wait_exit(server, 120) == 130
    summary = json.loads((out / "summary.json").read_text())
    assert "update norm far above the round's others" not in summary.get("admission", {}), \
        [line for line in text(server).splitlines() if "refused" in line]
    records = _records(out)
    first_with_5 = next(i for i, r in enumerate(records) if r["num_updates"] == 5)
    assert first_with_5 >= JOIN_AT
    # no round after its join waited without it but the ones client 3 was stopped for
    assert all(r["num_updates"] >= 4 for r in records[first_with_5:])
