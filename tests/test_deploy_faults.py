"""Faults between real processes: a client killed mid-round, a client restarted, Ctrl-C, a server gone.

Clients pause 0.3 s before training (tests.slow_plugin) so that a round is
still open when a test acts; heartbeats are fast so that a dead client is
noticed within a few seconds even on a loaded machine.
"""
import json
import time

import pytest

from tests.deploy_helpers import interrupt, server_port, text, wait_exit, wait_for, write_cfg

pytestmark = pytest.mark.slow

FAST_FAULTS = {
    "plugins": ["tests.slow_plugin"], "algorithm.name": "fedavg_pausing", "slow_test.pause": 0.3,
    "eval.clients": False, "distribute.insecure": True, "distribute.token": "t",
    "distribute.heartbeat_interval": 0.2, "distribute.heartbeat_timeout": 3.0,
    "distribute.retry_timeout": 2.0, "distribute.backoff_initial": 0.1, "distribute.backoff_max": 0.5,
}


def _records(out):
    f = out / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def _start(procs, tmp_path, rounds):
    cfg = write_cfg(tmp_path / "course.yaml", {**FAST_FAULTS, "federate.total_round_num": rounds,
                                               "federate.client_num": 2})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)

    def client(k, name=None):
        return procs.fedcore(name or f"client{k}", cfg, "distribute.role=client",
                             f"distribute.server_port={port}", f"distribute.client_id={k}")
    return out, server, client


def test_client_killed_mid_round_is_dropped_and_the_course_finishes(tmp_path, procs):
    out, server, client = _start(procs, tmp_path, rounds=5)
    clients = {k: client(k) for k in (1, 2)}
    wait_for(lambda: _records(out), 180, "the first round")
    clients[2].kill()  # SIGKILL in round 2: no goodbye; the server must notice the silence

    assert wait_exit(server, 180) == 0, text(server)[-3000:]
    log = text(server)
    assert "client 2 lost" in log and "no heartbeat" in log
    assert "dropped client(s) [2]" in log
    records = _records(out)
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["num_updates"] == 2 and records[-1]["num_updates"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert any(e["client"] == 2 for e in summary["lost_clients"])
    assert summary["deployment"]["clients"]["2"]["state"] == "lost"
    assert wait_exit(clients[1], 60) == 0


def test_restarted_client_rejoins_then_ctrl_c_and_a_vanished_server_end_everyone(tmp_path, procs):
    out, server, client = _start(procs, tmp_path, rounds=10_000)
    clients = {k: client(k) for k in (1, 2)}
    wait_for(lambda: _records(out), 180, "the first round")
    clients[2].kill()
    wait_for(lambda: "client 2 lost" in text(server), 60, "the server to notice client 2 is gone")
    lost_round = len(_records(out))
    clients[2] = client(2, "client2-restarted")

    # The new process joins under the same id and trains again from the next round on.
    wait_for(lambda: any(r["num_updates"] == 2 for r in _records(out)[lost_round + 1:]), 180,
             "a round with both clients after the restart")
    assert "client 2 admitted by" in text(clients[2])   # the new process, under the old id

    # Ctrl-C on a client: it says goodbye and exits 130; the server stops waiting for it.
    interrupt(clients[1])
    assert wait_exit(clients[1], 120) == 130
    assert text(clients[1]).strip().splitlines()[-1] == "fedcore: interrupted"
    wait_for(lambda: "client 1 lost" in text(server) and "left: interrupted" in text(server), 60,
             "the server to log client 1's goodbye")

    # Ctrl-C on the server: it writes its outputs and exits 130 ...
    interrupt(server)
    assert wait_exit(server, 120) == 130
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted" and summary["rounds"] >= lost_round + 2
    # ... and the client left without a server gives up after distribute.retry_timeout.
    assert wait_exit(clients[2], 60) == 4
    last = text(clients[2]).strip().splitlines()[-1]
    assert last.startswith("fedcore: no server at 127.0.0.1:") and "distribute.retry_timeout" in last


@pytest.mark.parametrize("by_server", [False, True], ids=["grpc-limit", "server-refusal"])
def test_a_server_busy_at_its_call_limit_is_retried_but_its_own_refusal_is_final(tmp_path, procs, by_server):
    # gRPC answers RESOURCE_EXHAUSTED for the server when its limit on concurrent calls is
    # reached (a burst of connections): the client waits and retries, as for a server not up
    # yet. The server's own RESOURCE_EXHAUSTED (every client id taken) is marked and final.
    from concurrent import futures

    import grpc

    from fedcore.comm.stream import REFUSED

    def connect(requests, context):
        if by_server:
            context.set_trailing_metadata(REFUSED)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "all 3 client ids are taken")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")

    busy = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    busy.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "fedcore.Fedcore", {"Connect": grpc.stream_stream_rpc_method_handler(connect)}),))
    port = busy.add_insecure_port("127.0.0.1:0")
    busy.start()
    try:
        cfg = write_cfg(tmp_path / "course.yaml", FAST_FAULTS)
        client = procs.fedcore("client", cfg, "distribute.role=client", f"distribute.server_port={port}",
                               "distribute.client_id=1")
        code = wait_exit(client, 60)
    finally:
        busy.stop(0)
    log = text(client)
    if by_server:
        assert code == 2 and "all 3 client ids are taken" in log
    else:
        assert code == 4 and "server busy" in log and "giving up" in log, log[-2000:]


def _server_that(frames_for):
    """A fake server whose Connect answers each call with `frames_for(call_number)`."""
    from concurrent import futures

    import grpc

    calls = []

    def connect(requests, context):
        calls.append(1)
        yield from frames_for(len(calls))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "fedcore.Fedcore", {"Connect": grpc.stream_stream_rpc_method_handler(connect)}),))
    return server, server.add_insecure_port("127.0.0.1:0")


def _welcome(client_id, **fields):
    from fedcore.wire import fedcore_pb2 as pb
    return pb.Frame(welcome=pb.Welcome(client_id=client_id, server_session="s",
                                       max_chunk_bytes=1 << 20, **fields)).SerializeToString()


def _message(msg_type, content, message_id):
    from fedcore.comm.chunking import chunk_frames, envelope_parts
    from fedcore.wire import fedcore_pb2 as pb
    from fedcore.wire.codec import encode_value
    header = pb.Envelope(msg_type=msg_type, sender=0, receivers=[1], round=1, timestamp=1.0)
    return list(chunk_frames(envelope_parts(header, encode_value(content)), message_id, 1 << 20))


SERVERS = {   # what a broken or hostile server does on every call, and how the client ends
    "welcomes-another-id": (lambda n: [_welcome(99)], 4, "welcome names client id 99, not 1"),
    "welcomes-twice": (lambda n: [_welcome(1), _welcome(1)], 4, "a second welcome on one stream"),
    # a negative resumed round would roll the client's saved state back to none
    "welcomes-resumed-at-a-negative-round": (lambda n: [_welcome(1, resumed_round=-3)], 4,
                                             "names resumed round -3, not a round"),
    "welcomes-then-hangs-up": (lambda n: [_welcome(1)], 4, "the server closed the stream"),
    "sends-an-unusable-model": (lambda n: [_welcome(1), *_message("models", {}, 1),
                                           *_message("finish", {}, 2)] if n == 1 else [],
                                0, "the server's 'models' could not be used"),
}


@pytest.mark.parametrize("kind", SERVERS)
def test_a_client_survives_what_a_broken_server_sends_and_gives_up_on_one_that_never_works(tmp_path, procs, kind):
    # a client leaves a server that breaks the protocol and dials again; one that never keeps
    # a session going is given up on after retry_timeout (exit 4, the last error named),
    # however often it welcomes; content its handlers cannot use is skipped with one line
    frames_for, code, said = SERVERS[kind]
    server, port = _server_that(frames_for)
    server.start()
    # A client that is to give up does so after short windows. One that is to finish must not
    # lose its first stream, which alone carries the finish message, to a race with the clock on
    # a loaded machine (its heartbeat watch fired before it had read the frames, and it never
    # saw the finish again): its windows are long, and its ending is the finish message.
    retry, silence = (3.0, 1.0) if code else (120.0, 60.0)
    try:
        cfg = write_cfg(tmp_path / "course.yaml", {**FAST_FAULTS, "distribute.retry_timeout": retry,
                                                   "distribute.heartbeat_timeout": silence})
        client = procs.fedcore("client", cfg, "distribute.role=client", f"distribute.server_port={port}",
                               "distribute.client_id=1")
        assert wait_exit(client, 180) == code, text(client)[-2000:]
    finally:
        server.stop(0)
    log = text(client)
    assert said in log and "Traceback" not in log, log[-2000:]


def test_a_client_started_before_its_server_says_it_cannot_reach_it_yet_under_its_own_id(tmp_path, procs):
    # Nothing listens on the port: the client never had a connection, so it has none to lose,
    # and it names itself by the id it was given (it has no other yet).
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = write_cfg(tmp_path / "course.yaml", {**FAST_FAULTS, "federate.client_num": 3,
                                               "distribute.retry_timeout": 1.5})
    client = procs.fedcore("client3", cfg, "distribute.role=client", f"distribute.server_port={port}",
                           "distribute.client_id=3")
    assert wait_exit(client, 60) == 4
    said = text(client)
    assert f"client 3: cannot reach the server at 127.0.0.1:{port} yet" in said
    assert "client None" not in said and " lost " not in said


def test_a_second_server_on_a_port_in_use_is_refused_in_one_line(tmp_path, procs):
    """gRPC opens its port for sharing by default: a second server would start beside the first
    and the clients would split between the two, both courses waiting for ever."""
    out, first, _ = _start(procs, tmp_path, rounds=5)
    port = server_port(out, first)
    second = procs.fedcore("second", tmp_path / "course.yaml", "distribute.role=server",
                           f"distribute.server_port={port}", f"outdir={tmp_path / 'out2'}")
    assert wait_exit(second, 60) == 2
    last = text(second).strip().splitlines()[-1]
    assert last == (f"fedcore: distribute.server_port: cannot listen on 127.0.0.1:{port} (already in use, "
                    "or not an address of this machine); pick a free port or another distribute.server_host")
    assert first.poll() is None   # the first server is untouched


def test_a_second_client_with_a_taken_id_says_so_when_it_gives_up(tmp_path, procs):
    out, server, client = _start(procs, tmp_path, rounds=30)
    first = client(1)
    wait_for(lambda: "client 1 joined" in text(server), 120, "client 1 joining")
    port = server_port(out, server)
    twin = procs.fedcore("twin", tmp_path / "course.yaml", "distribute.role=client",
                         f"distribute.server_port={port}", "distribute.client_id=1",
                         "distribute.retry_timeout=4")
    assert wait_exit(twin, 120) == 4, text(twin)[-3000:]
    log = text(twin)
    assert log.count("the server refuses this id for now") == 1
    last = log.strip().splitlines()[-1]
    assert "giving up" in last and "before, the server refused this client's id: " in last
    assert "another process with the same distribute.client_id?" in last
    assert first.poll() is None or first.returncode == 0


def test_a_server_waiting_for_every_client_says_so_at_the_join_timeout(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {**FAST_FAULTS, "federate.client_num": 2,
                                               "distribute.join_timeout": 1.0})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    procs.fedcore("client1", cfg, "distribute.role=client", f"distribute.server_port={port}",
                  "distribute.client_id=1")
    wait_for(lambda: "of the 2 clients have joined; the course starts when all have" in text(server),
             60, "the join timeout's line")
    time.sleep(1.5)
    assert text(server).count("join timeout:") == 1 and server.poll() is None   # said once; waiting


def test_a_course_on_an_ipv6_address_named_without_brackets_runs(tmp_path, procs):
    """`distribute.server_host: ::1` is an address as a user writes it; gRPC takes IPv6
    addresses in brackets, and the server used to fail to listen on it."""
    import socket
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    cfg = write_cfg(tmp_path / "course.yaml", {**FAST_FAULTS, "federate.total_round_num": 2,
                                               "federate.client_num": 2, "slow_test.pause": 0.0,
                                               "distribute.server_host": "::1"})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    assert (out / "server_address").read_text().strip() == f"[::1]:{port}"
    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client", f"distribute.server_port={port}",
                             f"distribute.client_id={k}") for k in (1, 2)]
    assert wait_exit(server, 120) == 0, text(server)[-3000:]
    assert all(wait_exit(c, 60) == 0 for c in clients)
    assert f"server listening on [::1]:{port}" in text(server)
