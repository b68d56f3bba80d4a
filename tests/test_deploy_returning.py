"""An honest client back from missed rounds, between real processes: client 5 joins a running
course late, or is stopped (SIGSTOP) just after joining, for longer than the heartbeat timeout,
and resumed. The model moved on without its data, so its honest updates are larger than the
others' for a while; a bound of 4 x the median of the others alone refused them. Admission scales a
returning client's update to the bound instead (fedcore/runtime/admission.py `Returning`): it is
aggregated, nothing is refused."""
import json
import signal

import pytest

from tests.deploy_helpers import interrupt, serve_course, text, wait_exit, wait_for, write_cfg

pytestmark = pytest.mark.slow

AWAY = 300   # rounds the course runs without client 5's data: by then its honest update is
# 6.7-9.2x the others' median (12-13x after 1,000 rounds) while theirs stay within 2.1x, so a
# bound of 4x (admission.norm_ratio) is well clear of both; at 10x, the ratio of 1,000 rounds
# (10.7-12.7) left some runs with nothing to scale
NORM_RATIO = 4.0


def _records(out):
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    text = f.read_text()
    text = text[:text.rfind("\n") + 1]   # a line the server is still writing is not read yet
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("how", ["late", "paused"])
def test_a_client_back_from_missed_rounds_has_its_next_honest_update_admitted(tmp_path, procs, how):
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 5, "federate.total_round_num": 100_000, "eval.freq": 100_000,
        "eval.clients": False, "distribute.min_clients": 4, "distribute.join_timeout": 0.5,
        "admission.norm_ratio": NORM_RATIO,
        "distribute.insecure": True, "distribute.token": "t",
        "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 2.0,
        "distribute.backoff_initial": 0.1, "distribute.backoff_max": 0.5})
    out = tmp_path / "out"
    server, _port, client = serve_course(procs, cfg, out)
    clients = {k: client(k) for k in (1, 2, 3, 4)}
    if how == "late":     # client 5 starts after AWAY rounds
        wait_for(lambda: len(_records(out)) >= AWAY, 300, f"{AWAY} rounds")
        clients[5] = client(5)
        wait_for(lambda: "client 5 joined the course" in text(server), 120, "client 5 to join")
    else:                 # client 5 stops as soon as it has joined, past the heartbeat timeout
        clients[5] = client(5)
        wait_for(lambda: "client 5 joined the course" in text(server), 120, "client 5 to join")
        clients[5].send_signal(signal.SIGSTOP)
        wait_for(lambda: "client 5 lost" in text(server), 60, "the server to lose client 5")
        wait_for(lambda: len(_records(out)) >= AWAY, 300, f"{AWAY} rounds")
        clients[5].send_signal(signal.SIGCONT)
    back = len(_records(out))
    wait_for(lambda: [r for r in _records(out)[back:] if r["num_updates"] == 5], 60,
             "a round with client 5's update")

    interrupt(server)
    assert wait_exit(server, 120) == 130
    summary = json.loads((out / "summary.json").read_text())
    admission = summary.get("admission", {})
    assert "update norm far above the round's others" not in admission, \
        [line for line in text(server).splitlines() if "refused" in line]
    # what the previous rule refused was admitted, at the bound
    assert admission["update of a returning client scaled to the bound"] >= 1
    assert len(_records(out)) >= AWAY
