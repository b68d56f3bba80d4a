"""Honest clients that missed rounds, between real processes: one joins a running course late,
one is stopped (SIGSTOP) just after joining, for longer than the heartbeat timeout, and resumed.
The model moved on without their data, so their honest updates are larger than the others' for
a while; 10 x the median of the others alone refused them. Admission scales a returning
client's update to the bound instead (fedcore/admission.py `Returning`), so both are
aggregated with nothing refused."""
import json
import signal

import pytest

from tests.deploy_helpers import interrupt, server_port, text, wait_exit, wait_for, write_cfg

pytestmark = pytest.mark.slow

JOIN_AT = 150   # rounds the course runs without the two clients' data (well under a minute)


def _records(out):
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def test_a_late_joiner_and_a_long_paused_client_have_their_next_honest_update_admitted(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 5, "federate.total_round_num": 100_000, "eval.freq": 100_000,
        "eval.clients": False, "distribute.min_clients": 3, "distribute.join_timeout": 0.5,
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

    # Client 3 stops as soon as it has joined, and stays stopped past the heartbeat timeout.
    wait_for(lambda: "client 3 joined the course" in text(server), 120, "client 3 to join")
    clients[3].send_signal(signal.SIGSTOP)
    wait_for(lambda: "client 3 lost" in text(server), 60, "the server to lose client 3")
    # The course runs JOIN_AT rounds without client 3's data (and without client 5's).
    wait_for(lambda: len(_records(out)) >= JOIN_AT, 300, f"{JOIN_AT} rounds")
    clients[3].send_signal(signal.SIGCONT)
    clients[5] = client(5)
    wait_for(lambda: "client 5 joined the course" in text(server), 120, "client 5 to join")
    joined = len(_records(out))
    wait_for(lambda: [r for r in _records(out)[joined:] if r["num_updates"] == 5], 60,
             "a round with both returned clients' updates")

    interrupt(server)
    assert wait_exit(server, 120) == 130
    summary = json.loads((out / "summary.json").read_text())
    admission = summary.get("admission", {})
    assert "update norm far above the round's others" not in admission, \
        [line for line in text(server).splitlines() if "refused" in line]
    # what the previous rule refused was admitted at the bound (a client that missed ~JOIN_AT rounds)
    assert admission["update of a returning client scaled to the bound"] >= 1
    records = _records(out)
    first_with_5 = next(i for i, r in enumerate(records) if r["num_updates"] == 5)
    assert first_with_5 >= JOIN_AT and "client 3 lost" in text(server)
