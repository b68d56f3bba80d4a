"""Resource bounds against real processes: idle sockets at a low descriptor limit, a 1 GiB
announcement, a message that stops half-way, a peer that stops reading."""
import hashlib
import json
import os
import resource
import socket
import threading
import time

import grpc
import pytest

from tests.deploy_helpers import server_port, text, wait_exit, wait_for, write_cfg
from tests.hostile import METHOD, Hostile, _value, load_proto

pytestmark = pytest.mark.slow

SMALL = {"federate.client_num": 1, "federate.total_round_num": 1, "eval.clients": False,
         "distribute.insecure": True, "distribute.token": "t"}


def _low_fd_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def _rss_peak_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_1100_idle_sockets_at_ulimit_1024_do_not_lock_a_client_out(tmp_path, procs):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"this test process may open only {hard} files; it needs 1,100 sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    cfg = write_cfg(tmp_path / "course.yaml", SMALL)
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}", preexec_fn=_low_fd_limit)
    port = server_port(out, server)
    idle = []
    try:
        for _ in range(1100):  # connect and say nothing: no TLS, no HTTP/2, no call
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            idle.append(s)
        # the server takes at most 1024 - 64 connections (distribute.max_connections' default)
        wait_for(lambda: len(os.listdir(f"/proc/{server.pid}/fd")) >= 950, 30, "the server's connections to fill")
        client = procs.fedcore("client", cfg, "distribute.role=client", f"distribute.server_port={port}",
                               "distribute.client_id=1")
        assert wait_exit(server, 180) == 0, text(server)[-3000:]
        assert wait_exit(client, 60) == 0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for s in idle:
            s.close()
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1


def test_a_1_gib_announcement_and_a_stalled_message_cost_the_server_no_memory(tmp_path, procs):
    pb = load_proto(tmp_path / "proto")
    cfg = write_cfg(tmp_path / "course.yaml", {
        **SMALL, "distribute.chunk_size": 64 * 1024, "distribute.heartbeat_interval": 0.5,
        "distribute.heartbeat_timeout": 2.0, "distribute.min_bytes_per_second": 100_000.0})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    time.sleep(1.0)
    before = _rss_peak_kib(server.pid)

    # 1 GiB announced (the default limit, derived from this small model, is about 1 MiB):
    # refused at its first chunk, whatever follows.
    for attempt in range(20):
        h = Hostile(pb, port, 1, "t", session=f"big-{attempt}").start()
        h.send_raw(bytes(64 * 1024) * 40, chunk=64 * 1024, total=2 ** 30)
        assert h.wait_for("never", timeout=30) is None
        assert h.status == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in h.details
        h.close()

    # A message under the limit that stops half-way while heartbeats go on: its stream is closed
    # once no chunk came within heartbeat_timeout + a chunk's time at min_bytes_per_second.
    h = Hostile(pb, port, 1, "t", session="stall").start()
    h.out.put(pb.Frame(chunk=pb.Chunk(message_id=1, offset=0, total_size=900_000, sha256=bytes(32),
                                      data=bytes(60_000))).SerializeToString())
    started = time.monotonic()
    for _ in range(480):   # heartbeats go on for up to 2 minutes: a safety net, not the claim
        if h.status is not None:
            break
        h.heartbeat()
        time.sleep(0.25)
    assert h.status == grpc.StatusCode.INVALID_ARGUMENT and "stalled" in h.details
    # closed for the stall, not for anything its heartbeats could have prevented, and not before
    # the stall's allowance: heartbeat_timeout (2 s) plus a chunk's time at min_bytes_per_second
    assert time.monotonic() - started >= 2.0 + 64 * 1024 / 100_000 - 0.5
    h.close()

    grown_mib = (_rss_peak_kib(server.pid) - before) / 1024
    print(f"\nfigures: server peak RSS {_rss_peak_kib(server.pid) / 1024:.0f} MiB, grown {grown_mib:.1f} MiB")
    assert grown_mib < 64, f"server peak RSS grew by {grown_mib:.0f} MiB"
    assert server.poll() is None
    server.terminate()
    wait_exit(server, 60)
    refused = json.loads((out / "summary.json").read_text())["deployment"]["refused"]
    assert refused["malformed message"] == 20 and refused["stalled message"] == 1


def test_a_peer_that_stops_reading_holds_at_most_three_streams_and_locks_no_one_out(tmp_path, procs):
    # A token holder joins as client 2 and never reads: the 4.8 MB model's write waits in flow
    # control for good. It then opens stream after stream under its session; each takes the
    # session over and gets stuck the same way. Its fourth and later calls are refused, so the
    # server's limit on concurrent calls (sized per id) keeps room for everyone else.
    pb = load_proto(tmp_path / "proto")
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 2, "federate.total_round_num": 1, "model.type": "mlp",
        "model.hidden": [100_000], "eval.clients": False, "distribute.insecure": True,
        "distribute.token": "t", "distribute.heartbeat_interval": 0.5,
        "distribute.heartbeat_timeout": 4.0, "distribute.round_deadline": 3.0})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    honest = procs.fedcore("client1", cfg, "distribute.role=client", f"distribute.server_port={port}",
                           "distribute.client_id=1")
    env = pb.Envelope(msg_type="join_in", sender=2, receivers=[0])
    env.content.CopyFrom(_value(pb, {"client_id": 2, "num_samples": 30}))
    data = env.SerializeToString()
    join = pb.Frame(chunk=pb.Chunk(message_id=1, offset=0, total_size=len(data), data=data,
                                   sha256=hashlib.sha256(data).digest())).SerializeToString()
    beat = pb.Frame(heartbeat=pb.Heartbeat(sent_at=0.0)).SerializeToString()
    stop = threading.Event()

    def frames(first):   # what the peer sends: heartbeats only, so it is never lost
        yield from first
        while not stop.wait(0.3):
            yield beat

    md = [("fedcore-client-id", "2"), ("fedcore-session", "stuck"), ("authorization", "Bearer t")]
    # one connection, none of whose streams is read, and whose receive window never grows
    # (gRPC's bandwidth probe could take it to ~8 MB, room for the whole model, whose write
    # would then not wait): each write waits for good. (Streams on connections of their own
    # would not stay: a session that moves to another connection leaves the old one closed.)
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)])]
    calls = []
    try:
        for k in range(5):
            calls.append(channels[0].stream_stream(METHOD)(frames([join] if k == 0 else []), metadata=md))
            if k == 0:   # the round starts once both joined: the model's write then waits
                wait_for(lambda: "client 1 joined the course" in text(server)
                         and "client 2 joined the course" in text(server), 60, "both clients to join")
            time.sleep(1.0 if k == 0 else 0.3)
        for call in calls[3:]:
            wait_for(call.done, 30, "the call beyond three to be refused")
            assert call.code() == grpc.StatusCode.UNAVAILABLE and "streams open" in call.details()
        assert not any(call.done() for call in calls[:3])
        channels[0].close()   # cancelled under a waiting write: the server ends that stream quietly
        assert wait_exit(server, 120) == 0, text(server)[-3000:]
        assert wait_exit(honest, 60) == 0
    finally:
        stop.set()
        for channel in channels:
            channel.close()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 1
    assert summary["deployment"]["refused"]["too many open streams for one id"] == 2
    log = text(server)
    assert "Traceback" not in log and "destroyed but it is pending" not in log, log[-3000:]
