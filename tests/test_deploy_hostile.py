"""One participant holding a valid token tries to poison, forge, impersonate: real processes.

The hostile participant (tests/hostile.py) is written from the .proto alone.
Two honest clients and the hostile one share one token (the weakest setup).
The hostile client sends updates of huge finite values and inflated sample
counts, answers each evaluation request several times (and rounds it was
never asked about), and a second hostile stream tries to take over honest
client 1's id. A client started with another model.type is refused at join
with one line naming the key. The honest course must finish: every honest
client exits 0, the final model is finite and of the honest clients' scale,
and every refusal is counted in the summary.
"""
import json
import math
import re

import grpc
import pytest
import torch

from tests.deploy_helpers import server_port, text, wait_exit, wait_for, write_cfg
from tests.hostile import Hostile, Tensor, load_proto

pytestmark = pytest.mark.slow

HUGE = 3e38


def _strict(path):
    def refuse(name):
        raise AssertionError(f"{path.name} holds {name}: not strict JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines() if line]


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _poisoner(h: Hostile, watch=lambda: None) -> int:
    """Play client 3 to the end: poisoned updates, forged metrics. Returns messages sent."""
    sent = 0
    h.send("join_in", 0, {"client_id": 3, "num_samples": 24})  # its partition's size
    while True:
        watch()
        item = h.inbox.get(timeout=180)
        if item is None or item[0] == "finish":
            return sent
        kind, round_, content = item
        if kind == "models":
            model = content["model"]
            if round_ % 2:   # huge finite values with an honest sample count
                update = {k: Tensor.full(t.shape, HUGE) for k, t in model.items()}
                n = 24
            else:            # the global model back, with an inflated sample count
                update, n = model, 2 ** 62
            h.send("updates", round_, {"model": update, "num_samples": n})
            sent += 1
        elif kind == "eval_request":
            for _ in range(3):                              # one is its answer; two are duplicates
                h.send("metrics", round_, {"acc": 1.0, "loss": 0.0})
            h.send("metrics", round_ + 7, {"acc": 1.0})      # a round it was never asked about
            sent += 4


def test_a_token_holder_cannot_poison_forge_or_take_over(tmp_path, procs):
    pb = load_proto(tmp_path / "proto")
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.total_round_num": 4, "model.type": "mlp", "model.hidden": [16],
        "admission.norm_ratio": 10.0, "distribute.insecure": True, "distribute.token": "shared",
        "distribute.heartbeat_interval": 0.5, "distribute.heartbeat_timeout": 5.0,
        "distribute.retry_timeout": 20.0})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    client = ("distribute.role=client", f"distribute.server_port={port}")
    honest = [procs.fedcore(f"client{k}", cfg, *client, f"distribute.client_id={k}") for k in (1, 2)]
    other_model = procs.fedcore("logreg", cfg, *client, "distribute.client_id=1", "model.type=logreg")

    # A client of another course is refused at join, on both sides, in one line.
    assert wait_exit(other_model, 120) == 2
    lines = text(other_model).strip().splitlines()
    assert "Traceback" not in text(other_model)
    assert lines[-1].startswith("fedcore: the server at 127.0.0.1:") and "model.type" in lines[-1]
    assert "course config differs" in lines[-1] and "mlp" not in lines[-1]   # keys, not values
    wait_for(lambda: "course config differs" in text(server), 30, "the server's line")

    wait_for(lambda: text(server).count("joined the course") >= 2, 120, "the honest clients")
    hostile = Hostile(pb, port, 3, "shared").start()
    # A second session for honest client 1's live id, with the shared token: refused, and told why.
    thief = Hostile(pb, port, 1, "shared", session="thief").start()
    thief.heartbeat()
    assert thief.wait_for("never", timeout=30) is None
    assert thief.status == grpc.StatusCode.ALREADY_EXISTS and "live session" in thief.details
    thief.close()

    peak = [0.0]

    def watch():
        peak[0] = max(peak[0], peak_rss_mib(server.pid))
    sent = _poisoner(hostile, watch)
    hostile.close()
    print(f"\nfigures: hostile messages {sent + 2}, server peak RSS {peak[0]:.0f} MiB")
    assert sent >= 4 + 4 * 4
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    assert all(wait_exit(c, 60) == 0 for c in honest), [text(c)[-2000:] for c in honest]

    summary = json.loads((out / "summary.json").read_text(), parse_constant=lambda n: 1 / 0)
    refused = summary["deployment"]["refused"]
    assert summary["rounds"] == 4 and summary["stopped_by"] == "max_rounds"
    assert summary["admission"]["update norm far above the round's others"] >= 2
    assert summary["admission"]["num_samples above the declared count"] >= 2
    assert refused["second session for a live id"] >= 1 and refused["course config differs"] >= 1
    assert refused["unrequested or duplicate metrics"] >= 3 * 4
    records = _strict(out / "metrics.jsonl")
    assert [r["num_updates"] for r in records] == [2, 2, 2, 2]   # the honest two, every round
    assert all(r["client_evals"] == 3 for r in records)           # one answer per client asked
    final = torch.load(out / "final_model.pt", weights_only=True)
    top = max(float(t.abs().max()) for t in final.values())
    assert math.isfinite(top) and top < 10.0
    assert records[-1]["test_acc"] > 0.5


# heartbeat_timeout of the hung-client tests: long enough that live processes on a loaded machine
# are not taken for dead; it is also the floor of the derived round deadline
HUNG_SILENCE = 10.0


def _derived_deadline(reason: str) -> float:
    """The least deadline a drop's reason names; it is derived from the clients' reply times
    (which a loaded machine lengthens), with distribute.heartbeat_timeout as its floor."""
    m = re.search(r"no reply within the derived round deadline of ([0-9.]+)(?:-[0-9.]+)?s "
                  r"\(distribute.deadline_factor\)", reason)
    assert m, reason
    return float(m.group(1))


def test_a_hung_trainer_with_live_heartbeats_is_dropped_by_the_default_deadline(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 2, "federate.total_round_num": 2, "eval.clients": False,
        "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.0,
        "slow_test.hang_clients": [2], "distribute.insecure": True, "distribute.token": "t",
        "distribute.heartbeat_interval": 0.5, "distribute.heartbeat_timeout": HUNG_SILENCE})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                             f"distribute.client_id={k}") for k in (1, 2)]
    assert wait_exit(server, 180) == 0, text(server)[-3000:]
    assert wait_exit(clients[0], 60) == 0
    assert clients[1].poll() is None  # still hung, heartbeats still flowing: never "lost"
    records = _strict(out / "metrics.jsonl")
    assert [r["num_updates"] for r in records] == [1, 1]
    summary = json.loads((out / "summary.json").read_text())
    # dropped once: a client that missed its deadline is not sampled again until it replies
    assert summary["dropped_total"] == 1 and "lost_clients" not in summary
    assert all(_derived_deadline(d["reason"]) >= HUNG_SILENCE and d["clients"] == [2] for d in summary["dropped"])


def test_a_hung_client_sampled_alone_is_dropped_by_the_deadline_of_earlier_rounds(tmp_path, procs):
    # one client per round: a round where it hangs never has half its replies; the deadline
    # comes from the earlier rounds (which complete between two of the server's checks)
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 3, "federate.sample_client_num": 1, "federate.total_round_num": 3,
        "eval.clients": False, "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing",
        "slow_test.pause": 0.0, "slow_test.hang_clients": [1], "distribute.insecure": True,
        "distribute.token": "t", "distribute.heartbeat_interval": 0.5, "distribute.heartbeat_timeout": HUNG_SILENCE})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                             f"distribute.client_id={k}") for k in (1, 2, 3)]
    assert wait_exit(server, 180) == 0, text(server)[-3000:]
    records = _strict(out / "metrics.jsonl")
    assert [r["num_updates"] for r in records] == [1, 1, 1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropped_total"] >= 1   # with seed 0, client 1 is sampled in round 2
    assert all(_derived_deadline(d["reason"]) >= HUNG_SILENCE and d["clients"] == [1] for d in summary["dropped"])
    assert all(wait_exit(c, 60) == 0 for c in clients[1:])


def test_a_client_on_a_100_kb_per_s_link_with_a_model_over_one_chunk_finishes_its_rounds(tmp_path, procs):
    """A chunk takes twice the heartbeat timeout on the link, as the default 2 MiB chunk does at
    100 KB/s against the default 10 s timeout; here every size and time is the default's over 4
    (a 512 KiB chunk, a 2.5 s timeout, 0.5 s heartbeats, a 64 KiB window), so that the model
    crosses the link in 2 x 5.5 s rather than 2 x 22 s."""
    from tests.throttle import Throttle
    scale = 4
    chunk = 2 * 1024 * 1024 // scale
    hidden = 46_000 // scale   # mlp 8 -> 11500 -> 3: 138,003 float32 parameters, 1.05 chunks
    params = 8 * hidden + hidden + hidden * 3 + 3
    assert chunk < 4 * params < 1.1 * chunk   # over one chunk, by as much as 2.2 MB over 2 MiB
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 2, "federate.total_round_num": 1, "eval.clients": False,
        "model.type": "mlp", "model.hidden": [hidden],
        "distribute.chunk_size": chunk, "distribute.stream_window": 256 * 1024 // scale,
        "distribute.heartbeat_interval": 2.0 / scale, "distribute.heartbeat_timeout": 10.0 / scale,
        "distribute.insecure": True, "distribute.token": "t"})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    link = Throttle(port, rate=100_000)
    fast = procs.fedcore("fast", cfg, "distribute.role=client", f"distribute.server_port={port}",
                         "distribute.client_id=1")
    slow = procs.fedcore("slow", cfg, "distribute.role=client", f"distribute.server_port={link.port}",
                         "distribute.client_id=2")
    try:
        assert wait_exit(server, 400) == 0, text(server)[-3000:]
        assert wait_exit(slow, 60) == 0 and wait_exit(fast, 60) == 0
    finally:
        link.close()
    records = _strict(out / "metrics.jsonl")
    assert [r["num_updates"] for r in records] == [2]
    assert link.moved > 2 * 4 * params  # the model went down and the update came up through the link
    for log in (text(server), text(slow)):
        assert "lost" not in log and "silent" not in log and "reconnect" not in log
