"""No token holder stalls a course, and no outsider or squatter keeps an honest client out.

Real processes on loopback; each test plays one attack of issue-31's list as its attacker
would, with the project's own client changed in one stage (tests.slow_plugin's trainer).
"""
import hashlib
import json
import re
import threading
import time

import grpc
import pytest

from tests.deploy_helpers import interrupt, make_certs, serve_course, server_port, text, wait_exit, wait_for, write_cfg
from tests.hostile import METHOD, Hostile, _value, load_proto
from tests.test_deploy_bounds import _low_fd_limit as low_fd_limit, _rss_peak_kib
from tests.test_deploy_faults import FAST_FAULTS

pytestmark = pytest.mark.slow

# the fault tests' course, with clients that do not pause, a 2 s heartbeat timeout and 20 s of retries
FAST = {**FAST_FAULTS, "slow_test.pause": 0.0, "distribute.heartbeat_timeout": 2.0,
        "distribute.retry_timeout": 20.0}


def _serve(procs, tmp_path, extra):
    """A server for `extra` on a free port, and a function that starts client k against it."""
    cfg = write_cfg(tmp_path / "course.yaml", {**FAST, **extra})
    out = tmp_path / "out"
    return (out, *serve_course(procs, cfg, out))


def _course(procs, tmp_path, extra):
    """A server and clients 1-3."""
    out, server, _port, client = _serve(procs, tmp_path, extra)
    return out, server, {k: client(k) for k in (1, 2, 3)}


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_a_client_replying_just_before_its_deadline_then_hanging_delays_the_course_once(tmp_path, procs):
    # Client 3 replies after 1.5 s in rounds 1-3, just inside its derived deadline of
    # max(heartbeat_timeout 2, 5 x the others' ~0.05 s) = 2 s, then hangs with its heartbeats
    # on. Its late replies must not lengthen its deadline (under the old rule each raised the
    # next one), it is dropped once, and the course goes on without waiting for it again.
    ceiling, rounds = 3.0, 8
    out, server, clients = _course(procs, tmp_path, {
        "federate.total_round_num": rounds, "distribute.max_round_deadline": ceiling,
        "slow_test.stall_clients": [3], "slow_test.stall": 1.5, "slow_test.stall_rounds": 3})
    assert wait_exit(server, 180) == 0, text(server)[-3000:]
    log = text(server)
    drops = re.findall(r"dropped client\(s\) \[([\d, ]+)\] from the round: .*deadline of ([\d.]+)s", log)
    assert len(drops) == 1 and drops[0][0] == "3", log[-3000:]
    transfer = 2 * (8 * 3 + 3) * 4 / 10_000          # the linear model's 27 floats, down and up
    assert 2.0 <= float(drops[0][1]) <= 2.0 + transfer + 0.01   # not ratcheted by its late replies
    records = _records(out)
    assert [r["num_updates"] for r in records] == [3, 3, 3] + [2] * (rounds - 3)
    wall = [r["wall_time"] for r in records]
    assert wall[3] - wall[2] <= ceiling + transfer + 1.0     # the one delay: round 4 waits for it
    # the later rounds do not wait for it: sampled, each would take its 2 s deadline
    assert wall[-1] - wall[3] < 2.0, wall
    for k in (1, 2):
        assert wait_exit(clients[k], 60) == 0


def _join_frame(pb, client_id, num_samples):
    env = pb.Envelope(msg_type="join_in", sender=client_id, receivers=[0])
    env.content.CopyFrom(_value(pb, {"client_id": client_id, "num_samples": num_samples}))
    data = env.SerializeToString()
    return pb.Frame(chunk=pb.Chunk(message_id=1, offset=0, total_size=len(data), data=data,
                                   sha256=hashlib.sha256(data).digest())).SerializeToString()


def test_a_squatters_declaration_ends_with_its_session(tmp_path, procs):
    # With the shared token, a squatter joins as client 3 before its real client starts,
    # declares num_samples 0 and says goodbye. The real client 3 is a new session: it starts
    # with a fresh declaration, so its updates (24 samples) are aggregated in every round.
    pb = load_proto(tmp_path / "proto")
    out, server, port, client = _serve(procs, tmp_path, {"federate.total_round_num": 3})
    squatter = Hostile(pb, port, 3, "t", session="squatter").start()
    squatter.out.put(_join_frame(pb, 3, 0))
    squatter.out.put(pb.Frame(bye=pb.Bye(reason="finished")).SerializeToString())
    wait_for(lambda: "client 3 gone before the course" in text(server), 30, "the squatter to leave")
    squatter.close()
    clients = {3: client(3)}
    wait_for(lambda: "client 3 admitted by" in text(clients[3]), 60, "the real client 3 to connect")
    clients.update({k: client(k) for k in (1, 2)})
    assert wait_exit(server, 180) == 0, text(server)[-3000:]
    assert [r["num_updates"] for r in _records(out)] == [3, 3, 3]
    assert "declared when it joined" not in text(server)
    assert all(wait_exit(c, 60) == 0 for c in clients.values())
    assert "refused its update" not in text(clients[3])


def test_a_client_whose_updates_are_refused_says_why_and_exits_non_zero(tmp_path, procs):
    # client 3's updates claim ten times the samples it declared: admission refuses each, and
    # the client is told: it logs why and its exit status says its work was thrown away
    out, server, clients = _course(procs, tmp_path, {
        "federate.total_round_num": 2, "slow_test.inflate_clients": [3]})
    assert wait_exit(server, 180) == 0, text(server)[-3000:]
    assert [r["num_updates"] for r in _records(out)] == [2, 2]
    assert wait_exit(clients[3], 60) == 1
    log = text(clients[3])
    assert "the server refused its update of round 1: num_samples above the declared count" in log
    assert log.strip().splitlines()[-1].startswith("fedcore: client 3: the course finished, but the "
                                                   "server refused 2 of its updates")
    assert all(wait_exit(clients[k], 60) == 0 for k in (1, 2))


def test_a_token_holder_trickling_a_large_message_gives_its_turn_to_the_waiting_updates(tmp_path, procs):
    # Messages of 16 MiB or more are received one at a time. A token holder (id 3, which never
    # joins) announces a 17 MiB message, then sends a byte every half second with heartbeats:
    # within distribute.min_bytes_per_second's allowance for the whole message (about 30 min),
    # so it kept the turn and the honest clients' 19 MB updates waited behind it, round after
    # round. While others wait, the message holding the turn must come at
    # distribute.turn_bytes_per_second after 5 s: the turn is taken back, the trickler's stream
    # ends UNAVAILABLE (its client would send the message again, behind the others), and the
    # course finishes at its own pace.
    pb = load_proto(tmp_path / "proto")
    out, server, port, client = _serve(procs, tmp_path, {
        "federate.total_round_num": 2, "model.type": "mlp", "model.hidden": [400_000],
        "distribute.min_clients": 2, "distribute.join_timeout": 2.0, "distribute.retry_timeout": 60.0})
    holder = Hostile(pb, port, 3, "t", session="trickle").start()
    total, got = 17 * 2 ** 20, 1024
    holder.out.put(pb.Frame(chunk=pb.Chunk(message_id=1, offset=0, total_size=total, data=bytes(got),
                                           sha256=bytes(32))).SerializeToString())
    assert holder.welcomed.wait(30), "the trickler was not admitted"
    stop = threading.Event()

    def trickle(got=got):
        while not stop.wait(0.5):
            holder.heartbeat()
            holder.out.put(pb.Frame(chunk=pb.Chunk(message_id=1, offset=got, total_size=total,
                                                   data=b"x")).SerializeToString())
            got += 1
    threading.Thread(target=trickle, daemon=True).start()
    try:
        clients = {k: client(k) for k in (1, 2)}
        assert wait_exit(server, 120) == 0, text(server)[-3000:]
    finally:
        stop.set()
    holder._thread.join(30)
    assert holder.status == grpc.StatusCode.UNAVAILABLE and "gave up its turn" in holder.details, \
        (holder.status, holder.details)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainable_params"] * 4 >= 16 * 2 ** 20          # the updates take turns too
    assert summary["deployment"]["refused"]["turn taken back"] == 1
    assert [r["num_updates"] for r in _records(out)] == [2, 2]
    assert all(wait_exit(c, 60) == 0 for c in clients.values())
    holder.close()


def test_a_trickler_that_stops_reading_its_stream_gives_its_turn_up_all_the_same(tmp_path, procs):
    # As above, but the token holder joins as client 3 and then reads nothing: the model sent
    # to it waits in flow control, so its stream's writer never gets to judge its pace. The
    # streams waiting for the turn judge it instead, and end it.
    pb = load_proto(tmp_path / "proto")
    out, server, port, client = _serve(procs, tmp_path, {
        "federate.total_round_num": 2, "model.type": "mlp", "model.hidden": [400_000],
        "distribute.round_deadline": 40.0, "distribute.retry_timeout": 60.0})
    total, stop = 17 * 2 ** 20, threading.Event()

    def frames(got=1024):   # its join, a large message's first chunk, then a byte every 0.5 s
        yield _join_frame(pb, 3, 30)
        yield pb.Frame(chunk=pb.Chunk(message_id=2, offset=0, total_size=total, data=bytes(got),
                                      sha256=bytes(32))).SerializeToString()
        while not stop.wait(0.5):
            yield pb.Frame(heartbeat=pb.Heartbeat(sent_at=0.0)).SerializeToString()
            yield pb.Frame(chunk=pb.Chunk(message_id=2, offset=got, total_size=total,
                                          data=b"x")).SerializeToString()
            got += 1
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)])
    md = [("fedcore-client-id", "3"), ("fedcore-session", "stuck"), ("authorization", "Bearer t")]
    call = channel.stream_stream(METHOD)(frames(), metadata=md)   # its replies are never read
    try:
        wait_for(lambda: "client 3 joined" in text(server), 30, "the trickler to join")
        clients = {k: client(k) for k in (1, 2)}
        assert wait_exit(server, 180) == 0, text(server)[-3000:]
    finally:
        stop.set()
        call.cancel()
        channel.close()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["deployment"]["refused"]["turn taken back"] == 1, summary["deployment"]
    assert [r["num_updates"] for r in _records(out)] == [2, 2], _records(out)   # the trickler's never comes
    assert all(wait_exit(c, 60) == 0 for c in clients.values())


def test_an_honest_client_whose_turn_is_taken_back_sends_its_update_again_and_the_round_has_it(tmp_path, procs):
    # Clients 1 and 2 upload 19 MB updates through links passing 300 KB/s, below
    # distribute.turn_bytes_per_second (1 MB/s). Whichever takes the turn first falls behind
    # while the other waits, so after its first 5 s its turn is taken back and its stream
    # ends UNAVAILABLE, marked to be sent again. Then the links get fast: that client dials
    # again on its own, sends the whole update again behind the other, and round 1 has both.
    from tests.throttle import Throttle
    out, server, port, _client = _serve(procs, tmp_path, {
        "federate.client_num": 2, "federate.total_round_num": 2, "model.type": "mlp",
        "model.hidden": [400_000], "distribute.round_deadline": 120.0, "distribute.retry_timeout": 60.0})
    links = {k: Throttle(port, rate=300_000, uplink_only=True) for k in (1, 2)}
    try:
        clients = {k: procs.fedcore(f"client{k}", tmp_path / "course.yaml", "distribute.role=client",
                                    f"distribute.server_port={links[k].port}", f"distribute.client_id={k}")
                   for k in (1, 2)}
        wait_for(lambda: "gave up its turn" in text(server), 90, "a slow update's turn to be taken back")
        for link in links.values():
            link.limited.clear()
        assert wait_exit(server, 120) == 0, text(server)[-3000:]
        assert all(wait_exit(c, 60) == 0 for c in clients.values())
    finally:
        for link in links.values():
            link.close()
    log = text(server)
    taken = re.findall(r"client (\d) \(\S+\): message gave up its turn for large messages: (\d+) bytes", log)
    assert len(taken) == 1, log[-3000:]
    who, got = int(taken[0][0]), int(taken[0][1])
    assert got < 19_000_000 / 2, taken     # it had sent part of its update when it lost the turn
    # the client was told why and sent the update again, as a working server's request
    assert "gave up its turn" in text(clients[who]) and "giving up" not in text(clients[who])
    records = _records(out)
    assert [r["num_updates"] for r in records] == [2, 2], records    # nothing lost: round 1 has both
    summary = json.loads((out / "summary.json").read_text())
    assert summary["deployment"]["refused"] == {"turn taken back": 1}, summary["deployment"]


def test_a_squatters_stuck_streams_end_with_its_session_and_keep_no_one_out(tmp_path, procs):
    # A token holder takes the free id 3 on three calls, joins, and reads none of them: the
    # 4.8 MB model's writes wait in flow control. It sends no heartbeat, so its session is
    # declared lost; its three calls must end with it, or the real client 3 is refused
    # ("still has 3 streams open") for as long as the squatter keeps the connections.
    pb = load_proto(tmp_path / "proto")
    out, server, port, client = _serve(procs, tmp_path, {
        "federate.total_round_num": 10_000, "model.type": "mlp", "model.hidden": [100_000],
        "distribute.heartbeat_timeout": 3.0, "distribute.round_deadline": 2.0})
    clients = {k: client(k) for k in (1, 2)}
    wait_for(lambda: "client 1 joined" in text(server) and "client 2 joined" in text(server), 60,
             "the honest clients to join")
    md = [("fedcore-client-id", "3"), ("fedcore-session", "squatter"), ("authorization", "Bearer t")]
    hold = threading.Event()

    def frames(first):   # what the squatter sends: its join, then nothing (no heartbeat)
        yield from first
        hold.wait(120)

    channels, calls = [], []
    try:
        for k in range(3):   # a connection of its own for each; none is read, nor grows its
            # receive window (the bandwidth probe could make room for the whole model)
            channels.append(grpc.insecure_channel(f"127.0.0.1:{port}",
                                                  options=[("grpc.use_local_subchannel_pool", 1),
                                                           ("grpc.http2.bdp_probe", 0)]))
            calls.append(channels[-1].stream_stream(METHOD)(
                frames([_join_frame(pb, 3, 30)] if k == 0 else []), metadata=md))
            time.sleep(1.0)   # the round starts; the model's write to this call waits
        try:
            wait_for(lambda: "client 3 lost" in text(server), 60, "the squatter's session to be lost")
        except AssertionError as exc:   # what the server did meanwhile
            raise AssertionError(f"{exc}; the server's log ends:\n{text(server)[-3000:]}") from None
        clients[3] = client(3)
        wait_for(lambda: any(r["num_updates"] == 3 for r in _records(out)), 60,
                 "a round with the real client 3")
        interrupt(server)
        assert wait_exit(server, 60) == 130, text(server)[-3000:]
    finally:
        hold.set()
        for channel in channels:
            channel.close()
    assert "streams open" not in text(server) + text(clients[3])
    assert "Traceback" not in text(server)


def _peak_kib(pid: int) -> int:
    """The process's peak RSS (0 if it has just exited)."""
    try:
        return _rss_peak_kib(pid)
    except (OSError, AssertionError):   # gone, or a zombie without memory
        return 0


HOSTILE_SERVER = {**FAST, "model.type": "mlp", "model.hidden": [25_000],
                  "distribute.retry_timeout": 6.0, "distribute.heartbeat_timeout": 2.0}
MODEL_BYTES = (8 * 25_000 + 25_000 + 25_000 * 3 + 3) * 4   # the mlp's float32 parameters: 1.2 MB


def _clients_against(procs, tmp_path, cfg, modes) -> dict[str, float]:
    """Run client 1 against tests.hostile_server in each of `modes`, all at once (each pair its
    own processes): every client's exit code must be 4 (no server for retry_timeout); returns,
    per mode, how many bytes the client's peak RSS grew by after the welcome."""
    hostiles = {m: procs.start(f"hostile-{m}", ["-m", "tests.hostile_server", str(cfg), m,
                                                str(tmp_path / f"port-{m}")]) for m in modes}

    def port(m):
        f = tmp_path / f"port-{m}"
        return int(wait_for(lambda: f.exists() and f.read_text(), 120, f"the hostile server ({m})"))
    clients = {m: procs.fedcore(f"client-{m}", cfg, "distribute.role=client", f"distribute.server_port={port(m)}",
                                "distribute.client_id=1") for m in modes}
    before: dict[str, int] = {}   # each client's peak RSS at its welcome, read as soon as it is logged
    peak, started = {}, time.monotonic()
    while any(c.poll() is None for c in clients.values()) and time.monotonic() - started < 240:
        for m, c in clients.items():
            if m not in before and "client 1 admitted by" in text(c):
                before[m] = peak[m] = _peak_kib(c.pid)
            elif m in before:
                peak[m] = max(peak[m], _peak_kib(c.pid))
        time.sleep(0.1)
    assert before.keys() == clients.keys(), {m: text(c)[-2000:] for m, c in clients.items() if m not in before}
    for m, client in clients.items():
        assert wait_exit(client, 5) == 4, text(client)[-3000:]
        hostiles[m].kill()
        log = text(client)
        assert "giving up" in log and "Traceback" not in log, log[-3000:]
        if m != "rewelcome":
            assert ("exceeds" if m == "huge" else "more values") in log, log[-3000:]
    return {m: (peak[m] - before[m]) * 1024 for m in modes}


def test_a_client_against_a_hostile_server_stays_small_and_gives_up_after_its_retry_timeout(tmp_path, procs):
    # The project's server with one stage changed (tests.hostile_server): after the welcome it
    # ends every call (no round ever starts), or sends a 900 MB 'models' message, or one of
    # empty values just under the client's byte bound (2.9 M values, hundreds of MB decoded).
    # The client reads nothing past the welcome before its course has set its bounds from its
    # own model, refuses both messages before buffering or decoding them (again on each of the
    # dozens of calls it is welcomed on), and gives up after retry_timeout (exit 4). Its memory
    # grows past what the course's own build takes (the first case) by a small multiple of
    # its byte bound (4 x the model + 1 MiB): gRPC's buffers of the calls' frames, not decoding.
    cfg = write_cfg(tmp_path / "course.yaml", HOSTILE_SERVER)
    grown = _clients_against(procs, tmp_path, cfg, ("rewelcome", "huge", "empty-values"))
    bound = 4 * MODEL_BYTES + 2 ** 20
    print("\nfigures: client peak RSS growth after the welcome: "
          + ", ".join(f"{m} {g / 2 ** 20:.1f} MiB" for m, g in grown.items()) + f"; byte bound {bound / 2 ** 20:.1f} MiB")
    for mode in ("huge", "empty-values"):
        assert grown[mode] - grown["rewelcome"] < 16 * bound, grown


def test_messages_built_to_decode_into_far_more_than_their_size_are_refused_before_decoding(tmp_path, procs):
    # Three token holders at once each send an 'updates' message just under the server's byte
    # bound made of empty values (2 bytes each, some 100 bytes each once decoded): refused by
    # the census of its encoding before protobuf builds anything, so the server's memory grows
    # by about the bytes it buffered, not by what they would decode into.
    pb = load_proto(tmp_path / "proto")
    from tests.hostile_server import empty_values_envelope
    cfg = write_cfg(tmp_path / "course.yaml", HOSTILE_SERVER)
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    bound = 4 * MODEL_BYTES + 2 ** 20                    # distributed.message_bound of this model
    data = empty_values_envelope(bound - 4096, 0)
    hostile = []
    time.sleep(1.0)
    before = _peak_kib(server.pid)
    for k in (1, 2, 3):
        h = Hostile(pb, port, k, "t", session=f"values-{k}").start()
        h.send_raw(data, chunk=1 << 20)   # (its header is never read: the census comes first)
        hostile.append(h)
    for h in hostile:
        assert h.wait_for("never", timeout=60) is None
        assert h.status == grpc.StatusCode.INVALID_ARGUMENT and "more values" in h.details, h.details
        h.close()
    grown = (_peak_kib(server.pid) - before) * 1024
    print(f"\nfigures: 3 x {len(data) / 1e6:.1f} MB of empty values: server peak RSS grew by "
          f"{grown / 2 ** 20:.1f} MiB")
    assert grown < 2 * 3 * len(data) + 16 * 2 ** 20, f"{grown / 2 ** 20:.0f} MiB"
    server.terminate()
    wait_exit(server, 60)
    refused = json.loads((out / "summary.json").read_text())["deployment"]["refused"]
    assert refused["malformed message"] == 3


def test_1100_connections_sending_refused_calls_at_ulimit_1024_do_not_keep_a_client_out(tmp_path, procs):
    # An outsider opens 1,100 HTTP/2 connections to a server that may open 1,024 files and
    # sends a call without a token on each every 4 s, reopening any the server closes. Refused
    # calls no longer keep a connection alive (each is closed half a second after its refusal),
    # the server takes at most 1,024 - 64 connections and one address holds at most a quarter
    # of them, so a real client started during the attack joins within its retry window and
    # the course finishes.
    import resource
    from tests.h2_attack import RefusedCallFlood
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1500:
        pytest.skip(f"this test process may open only {hard} files; it needs 1,100 sockets and more")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1500), hard))
    cfg = write_cfg(tmp_path / "course.yaml", {**FAST, "federate.client_num": 1, "federate.total_round_num": 1,
                                               "distribute.retry_timeout": 60.0})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}", preexec_fn=low_fd_limit)
    port = server_port(out, server)
    flood = RefusedCallFlood(port, 1100, every=4.0).start()
    try:
        wait_for(lambda: flood.calls >= 2000, 60, "the flood's first calls")
        client = procs.fedcore("client", cfg, "distribute.role=client", f"distribute.server_port={port}",
                               "distribute.client_id=1")
        assert wait_exit(server, 120) == 0, text(server)[-3000:]
        assert wait_exit(client, 60) == 0, text(client)[-3000:]
        calls, reopened = flood.calls, flood.reopened
    finally:
        flood.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    summary = json.loads((out / "summary.json").read_text())
    refused = summary["deployment"]["refused"]
    print(f"\nfigures: {calls} refused calls sent, {reopened} connections reopened by the attacker; "
          f"server refusals {refused}")
    assert summary["rounds"] == 1
    # the server takes 1024 - 64 = 960 connections at a time, 240 of them (a quarter) from
    # one address; each is closed, for its refused call or as one beyond 127.0.0.1's cap,
    # whatever else happens (the course may finish within the first sweep)
    assert refused["wrong or missing token"] >= 900
    assert (refused.get("connections closed after a refused call", 0)
            + refused.get("connections closed beyond their address's cap", 0)) >= 900


def test_connections_beyond_an_addresss_cap_are_closed_and_other_addresses_keep_theirs(tmp_path, procs):
    # An outsider at 127.0.0.2 holds 60 HTTP/2 connections, past their preface and silent, to
    # a server capping each address at 20; another at 127.0.0.3 holds 10. Within the guard's
    # sweep (1 s) the server closes 60 - 20 = 40 of the first address's and none of the
    # second's, and a real client at 127.0.0.1 joins and finishes the course meanwhile.
    from tests.h2_attack import closed_by_server, idle_connections
    cfg = write_cfg(tmp_path / "course.yaml", {**FAST, "federate.client_num": 1, "federate.total_round_num": 1,
                                               "distribute.max_connections_per_address": 20})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0", f"outdir={out}")
    port = server_port(out, server)
    try:
        crowd, few = idle_connections(port, 60, "127.0.0.2"), idle_connections(port, 10, "127.0.0.3")
    except OSError as exc:
        pytest.skip(f"no loopback address beyond 127.0.0.1 here: {exc}")
    started = time.monotonic()
    try:
        wait_for(lambda: sum(map(closed_by_server, crowd)) >= 40, 8, "the connections beyond the cap to be closed")
        took = time.monotonic() - started
        # gRPC's own idle timeout (10 s) has not come yet: the closing was the cap's
        assert took < 8.0
        assert sum(map(closed_by_server, crowd)) == 40
        assert not any(map(closed_by_server, few))
        client = procs.fedcore("client", cfg, "distribute.role=client", f"distribute.server_port={port}",
                               "distribute.client_id=1")
        assert wait_exit(server, 120) == 0, text(server)[-3000:]
        assert wait_exit(client, 60) == 0, text(client)[-3000:]
    finally:
        for s in crowd + few:
            s.close()
    print(f"\nfigures: 40 connections beyond the cap closed {took:.2f} s after they were opened")
    refused = json.loads((out / "summary.json").read_text())["deployment"]["refused"]
    assert refused["connections closed beyond their address's cap"] == 40


def test_a_client_on_the_port_of_a_connection_just_closed_for_its_refusals_is_admitted(tmp_path, procs):
    # The guard knows a connection by its peer's address and port, and a client sharing the
    # attacker's address may get the very port of a connection the guard has just closed
    # (Linux hands a freed port out again at once): under a flood a restarted client was kept
    # out for 20 s that way. A call carrying a valid token is admitted whatever the guard
    # remembers of its port; before, it was held as the closed connection's leftover.
    import socket
    from tests.h2_attack import ACK, PREFACE, SETTINGS, call_headers, closed_by_server, frame
    out, server, port, _client = _serve(procs, tmp_path, {"federate.total_round_num": 1})

    def dial(source_port: int = 0) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", source_port))
        s.connect(("127.0.0.1", port))
        s.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
        return s

    attacker = dial()
    reused = attacker.getsockname()[1]
    attacker.sendall(b"".join(call_headers(port, sid, end_stream=False) for sid in (1, 3, 5, 7, 9)))
    wait_for(lambda: closed_by_server(attacker), 10, "the guard to close the token-less connection")
    attacker.close()
    honest = dial(reused)
    try:
        honest.sendall(call_headers(port, 1, end_stream=False, metadata=(
            (b"authorization", b"Bearer t"), (b"fedcore-session", b"reused-port"))))
        wait_for(lambda: f"client 1 connected from ipv4:127.0.0.1:{reused}" in text(server), 10,
                 "the call with a valid token on the reused port to be admitted")
    finally:
        honest.close()


def test_calls_to_a_method_the_server_does_not_serve_close_their_connection(tmp_path, procs):
    # An outsider's connection sends a call to a made-up method every 0.3 s: gRPC would answer
    # each itself (UNIMPLEMENTED) without the guard ever hearing of it, and the calls would
    # keep the connection from gRPC's idle timeout (10 s) for as long as the outsider likes.
    # The server refuses them as it refuses calls without a token: the connection is closed
    # half a second after the first, and a client joins and finishes the course meanwhile.
    from tests.h2_attack import call_headers, closed_by_server, idle_connections
    cfg = write_cfg(tmp_path / "course.yaml", {**FAST, "federate.client_num": 1, "federate.total_round_num": 1})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0", f"outdir={out}")
    port = server_port(out, server)
    conn = idle_connections(port, 1)[0]
    started, stream, closed = time.monotonic(), 1, False
    while time.monotonic() - started < 8.0 and not closed:
        try:
            conn.send(call_headers(port, stream, path=b"/fedcore.Fedcore/Connecx"))
        except OSError:
            pass
        stream += 2
        time.sleep(0.3)
        closed = closed_by_server(conn)
    took = time.monotonic() - started
    conn.close()
    assert closed and took < 5.0, took   # the guard's doing: gRPC's idle timeout is 10 s away
    client = procs.fedcore("client", cfg, "distribute.role=client", f"distribute.server_port={port}",
                           "distribute.client_id=1")
    assert wait_exit(server, 120) == 0, text(server)[-3000:]
    assert wait_exit(client, 60) == 0, text(client)[-3000:]
    refused = json.loads((out / "summary.json").read_text())["deployment"]["refused"]
    assert refused["unknown method"] >= 1 and refused["connections closed after a refused call"] >= 1, refused
    print(f"\nfigures: the connection was closed {took:.2f} s after its first call to an unknown method")


def test_a_session_that_moves_to_another_connection_leaves_the_old_one_closed(tmp_path, procs):
    # A token holder is admitted as client 3 on one connection after another, under one
    # session (each admission a reconnect), keeping each connection it leaves busy. Only the
    # connection its session is on now is a participant's: each one left behind is closed
    # half a second later, so one token cannot hold a connection per admission (it held all
    # 960 of a server at ulimit 1024 this way). Then the real client 3 joins and the course ends.
    pb = load_proto(tmp_path / "proto")
    out, server, port, client = _serve(procs, tmp_path, {"federate.total_round_num": 2})
    honest = {k: client(k) for k in (1, 2)}
    squatters = []
    try:
        for _ in range(5):
            h = Hostile(pb, port, 3, "t", session="squat", own_connection=True).start()
            h.heartbeat()
            assert h.welcomed.wait(30), (h.status, h.details)   # admitted
            squatters.append(h)
            time.sleep(1.5)
            for earlier in squatters[:-1]:   # still sending, as an attacker keeping them busy
                earlier.heartbeat()
        assert all(h.status is not None for h in squatters[:-1]), [h.status for h in squatters]
        assert squatters[-1].status is None
    finally:
        for h in squatters:
            h.close()
    honest[3] = client(3)
    assert wait_exit(server, 120) == 0, text(server)[-3000:]
    for k, p in honest.items():
        assert wait_exit(p, 60) == 0, text(p)[-3000:]
    refused = json.loads((out / "summary.json").read_text())["deployment"]["refused"]
    assert refused["connections closed after their session moved to another"] == 4, refused


def test_a_session_may_not_hop_back_to_a_connection_it_left(tmp_path, procs):
    # A connection a session left is closed half a second later unless a live session uses it
    # then; a session hopping back in time would keep it (a token holder kept 10 connections
    # under one id so). Coming back within REVISIT seconds is refused, so the connection ends.
    from fedcore.comm.sessions import REVISIT
    pb = load_proto(tmp_path / "proto")
    out, server, port, client = _serve(procs, tmp_path, {"federate.total_round_num": 1,
                                                         "distribute.heartbeat_timeout": 30.0})
    md = [("fedcore-client-id", "3"), ("fedcore-session", "hop"), ("authorization", "Bearer t")]
    beat = pb.Frame(heartbeat=pb.Heartbeat(sent_at=0.0)).SerializeToString()
    stop = threading.Event()

    def beats():
        while not stop.wait(0.1):
            yield beat

    def call(channel):
        rpc = channel.stream_stream(METHOD)(beats(), metadata=md)
        first = next(iter(rpc))   # the welcome, or the refusal raised here
        assert pb.Frame.FromString(first).WhichOneof("kind") == "welcome"
        return rpc

    a, b = (grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(2))
    states = []   # a's connectivity: READY while its connection is up, IDLE once the server closed it
    a.subscribe(states.append)
    try:
        call(a)
        on_b = call(b)                 # the session moves to b: a is left
        with pytest.raises(grpc.RpcError) as back:
            call(a)                    # back to a at once, before its closing
        assert back.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "moved off this connection" in back.value.details() and f"{REVISIT:g}s" in back.value.details()
        wait_for(lambda: states and states[-1] != grpc.ChannelConnectivity.READY, 10,
                 "the server to close the connection left behind")
        assert not on_b.done()
    finally:
        stop.set()
        for ch in (a, b):
            ch.close()
    interrupt(server)
    assert wait_exit(server, 60) == 130, text(server)[-3000:]
    refused = json.loads((out / "summary.json").read_text())["deployment"]["refused"]
    assert refused["session back on a connection it left"] == 1, refused
    # closed as left behind, or for the refusal on it, whichever came first
    assert (refused.get("connections closed after their session moved to another", 0)
            + refused.get("connections closed after a refused call", 0)) >= 1, refused


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _tls_course(procs, tmp_path, extra):
    """`_serve`'s server and clients over TLS: the server has a certificate, each client the CA
    that checks it (no client certificates: tokens admit clients, as on a plaintext server)."""
    certs = make_certs(tmp_path / "certs")
    tls = {**FAST, **extra, "distribute.insecure": False}
    cfg = write_cfg(tmp_path / "course.yaml", {**tls, "distribute.tls.cert": certs["server_cert"],
                                                "distribute.tls.key": certs["server_key"]})
    client_cfg = write_cfg(tmp_path / "client.yaml", {**tls, "distribute.tls.ca": certs["ca"]})
    out = tmp_path / "out"
    server, port, _ = serve_course(procs, cfg, out)

    def client(k):
        return procs.fedcore(f"client{k}", client_cfg, "distribute.role=client",
                             f"distribute.server_port={port}", f"distribute.client_id={k}")
    return out, server, port, client


def _stream_flood(procs, tmp_path, kind: str) -> dict:
    """A course of 3 clients under a stream flood of `kind` on 8 connections (tests.h2_attack,
    its own process at the lowest priority; a kind ending in '-tls' floods a TLS server over
    TLS). The flood is paused and resumed (SIGSTOP and
    SIGCONT) in four alternating 3 s windows; then, the flood going on, client 3 is killed and
    started again and must join (some 400,000 calls in all). Returns the figures (the rate the course keeps is measured,
    against a control, by `python -m bench.flood_rate`)."""
    import os
    import signal
    tls = kind.endswith("-tls")
    extra = {"federate.total_round_num": 1_000_000, "distribute.max_streams_per_connection": 4}
    out, server, port, client = (_tls_course if tls else _serve)(procs, tmp_path, extra)
    clients = {k: client(k) for k in (1, 2, 3)}
    metrics = out / "metrics.jsonl"

    def rounds():
        return metrics.read_text().count("\n") if metrics.exists() else 0

    wait_for(lambda: rounds() >= 20, 120, "the course's first rounds")
    time.sleep(1.0)
    rss_before = _rss_kib(server.pid)
    report = tmp_path / f"{kind}.json"
    attacker = procs.start(f"attack-{kind}", ["-m", "tests.h2_attack", str(port), kind.removesuffix("-tls"),
                                              "8", "300", str(report), *(["tls"] if tls else [])])
    done = {True: [0, 0.0], False: [0, 0.0]}   # attacking -> [rounds, seconds]
    flooded = []   # rounds in each window of the flood
    pauses = []    # [stopped, resumed] of the attacker
    for window in range(4):
        attacking = window % 2 == 1
        os.kill(attacker.pid, signal.SIGCONT if attacking else signal.SIGSTOP)
        if attacking:
            pauses[-1][1] = time.monotonic()
        else:
            pauses.append([time.monotonic(), float("inf")])
        time.sleep(0.5)   # the flood stopped (its connections closed) or under way again
        first, started = rounds(), time.monotonic()
        time.sleep(2.5)
        n = rounds() - first
        done[attacking][0] += n
        done[attacking][1] += time.monotonic() - started
        if attacking:
            flooded.append(n)
    # a client started during the flood joins: client 3 killed, lost, then started again
    clients[3].kill()
    wait_exit(clients[3], 30)
    wait_for(lambda: "client 3 lost" in text(server), 60, "client 3's loss")
    rejoin_started = time.monotonic()
    clients[3] = client(3)
    wait_for(lambda: text(clients[3]).count("client 3 admitted by") == 2, 60, "client 3 to join again")
    joined_after = time.monotonic() - rejoin_started
    lost_at = rounds()
    wait_for(lambda: rounds() > lost_at + 5 and json.loads(metrics.read_text().splitlines()[-1])["num_updates"] == 3,
             60, "a round with client 3 again")
    assert attacker.poll() is None, "the flood ended before client 3 joined"
    attacker.terminate()
    assert wait_exit(attacker, 60) == 0, text(attacker)[-2000:]
    time.sleep(3.0)
    rss_after = _rss_kib(server.pid)
    interrupt(server)
    assert wait_exit(server, 60) == 130, text(server)[-3000:]
    figures = json.loads(report.read_text())
    figures.update(rate_off=done[False][0] / done[False][1], rate_on=done[True][0] / done[True][1],
                   fewest_rounds_flooded=min(flooded), joined_after=joined_after,
                   rss_grown_mib=(rss_after - rss_before) / 1024)
    # how long each connection lived, from its preface to the attacker seeing it closed; not
    # those open across a pause, which the stopped attacker saw only once it was resumed
    lifetimes = sorted(closed - opened for opened, closed in figures.pop("spans")
                       if not any(opened < resumed and closed > stopped for stopped, resumed in pauses))
    assert len(lifetimes) >= 20, figures
    figures.update(lifetime_median=lifetimes[len(lifetimes) // 2],
                   lifetime_p95=lifetimes[int(0.95 * len(lifetimes))])
    figures["refused"] = json.loads((out / "summary.json").read_text())["deployment"]["refused"]
    print(f"\nfigures ({kind}): " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                                for k, v in figures.items()}))
    assert "Traceback" not in text(server)
    return figures


@pytest.mark.alone   # rates and memory compared between windows: another worker's load would land on one only
@pytest.mark.parametrize("kind", ["rapid-reset", "header-flood", "rapid-reset-tls"])
def test_a_rapid_reset_or_header_flood_is_closed_fast_and_keeps_no_client_out(tmp_path, procs, kind):
    # An outsider opens token-less calls on 8 connections as fast as its socket allows, each
    # reset at once (rapid reset) or left open (header flood), reopening every connection the
    # server closes. Each client has its own process, so a connection may open 4 streams
    # (distribute.max_streams_per_connection). Its first refused call is answered, the next
    # ones are held unanswered, so its stream slots stay taken and gRPC refuses the rest in its
    # transport; it is closed 0.5 s after its first refusal, or at once at its 6th (its calls
    # reset, so they keep coming: rapid reset), sent GOAWAY first (ENHANCE_YOUR_CALM) where the
    # server is plaintext; under TLS the frame would have to be encrypted in gRPC's session, so
    # the connection just ends. The calls it still has queued are ended unread, so the
    # course goes on through every window of the flood, the server's memory comes back, and a
    # client started during the flood joins. After taking a call gRPC had queued for a closed
    # connection, the server waits 1 ms before taking its next, so gRPC drops the rest of a
    # rapid reset's calls itself. The rate it keeps (at least half, against a control) is a
    # speed figure: bench/flood_rate.py.
    f = _stream_flood(procs, tmp_path, kind)
    assert f["calls"] >= 50_000, f                    # a flood, not a trickle
    # closed 0.5 s after its first refusal, or at its 6th (0.02-0.05 s under rapid reset)
    assert f["lifetime_p95"] < (2.0 if kind == "header-flood" else 0.5), f
    if kind.endswith("-tls"):
        assert f["closed"] > 0, f
    else:
        # the GOAWAY is written without waiting: a connection whose socket buffer is full gets
        # none (measured: every closed connection had one, 4,182 and 3,465)
        assert f["goaways"] >= 0.9 * f["closed"] > 0, f
    # not starved: the unguarded server ran 10x slower under the header flood
    assert f["fewest_rounds_flooded"] >= 1 and f["rate_on"] >= 0.1 * f["rate_off"], f
    if kind.startswith("rapid-reset"):
        # gRPC handed the server calls it parsed from connections the guard had closed: after
        # them the server held its asks for further calls back (comm/ask_pacing.py)
        assert f["refused"]["asks for a call held back after a call of a closed connection"] > 0, f
    assert f["rss_grown_mib"] < 64, f
