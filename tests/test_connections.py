"""The connection guard's arithmetic and its per-address sweep, on real loopback sockets."""
import socket
import threading
import sys

import pytest

from fedcore.comm.connections import ConnectionGuard, _address, _peer_string, address_cap, peer_key


def test_address_cap_is_a_quarter_of_the_total_at_least_16_unless_configured():
    assert address_cap(None, 960) == 240          # ulimit -n 1024 less 64, over 4
    assert address_cap(None, 40) == 16
    assert address_cap(None, None) is None        # no total cap known: no per-address cap
    assert address_cap(7, 960) == 7


@pytest.mark.parametrize("peer, address", [("ipv4:10.0.0.7:51324", ("10.0.0.7", 51324)),
                                           ("ipv6:[::1]:443", ("::1", 443))])
def test_peer_strings_and_addresses_are_inverse(peer, address):
    assert _address(peer) == address and _peer_string(address) == peer


def _closed(s: socket.socket, said: list | None = None) -> bool:
    """Whether the other end shut `s` down (what it sent first appended to `said`)."""
    s.settimeout(0.5)   # a shut down end reads as closed at once
    got = b""
    try:
        while True:
            part = s.recv(4096)
            if not part:
                if said is not None:
                    said.append(got)
                return True
            got += part
    except TimeoutError:
        return False


class _Loop:
    """Records what the guard schedules instead of running it."""
    def __init__(self):
        self.later = []

    def call_later(self, delay, fn, *args):
        self.later.append((delay, fn))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard counts sockets in /proc/self/fd")
def test_a_sweep_closes_the_connections_beyond_an_addresss_cap_but_not_admitted_ones():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        dialled = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0)) for _ in range(5)]
    except OSError as exc:
        pytest.skip(f"no loopback address beyond 127.0.0.1 here: {exc}")
    accepted = [listener.accept()[0] for _ in dialled]
    # this process holds both ends: the dialled ends' peer is 127.0.0.1 (one connection each,
    # below the cap), the accepted ends' is 127.0.0.2 (five, over a cap of 2)
    keep = {accepted[0].getpeername()}
    guard = ConnectionGuard(_Loop(), lambda peer: _address(peer) in keep, per_address=2)
    guard._sweep()
    assert guard.over_cap == 3
    said = []
    ended = {s.getsockname() for s in dialled if _closed(s, said)}
    assert len(ended) == 3 and not ended & keep   # the admitted one is kept
    # each told first: a GOAWAY frame (RFC 9113 6.8: length 8, type 7, no flags, stream 0),
    # last stream id 0, error ENHANCE_YOUR_CALM (0xb)
    assert said == [bytes.fromhex("000008" "07" "00" "00000000" "00000000" "0000000b")] * 3
    assert guard.loop.later and guard.loop.later[-1][0] >= 1.0   # the next sweep is scheduled
    for s in dialled + accepted + [listener]:
        s.close()


def test_peers_are_the_same_connection_however_grpc_writes_them():
    # gRPC 1.85 writes an IPv6 peer with its brackets escaped; older releases did not
    assert _address("ipv6:%5B::1%5D:5") == _address("ipv6:[::1]:5") == ("::1", 5)
    assert peer_key("ipv6:%5B::1%5D:5") == peer_key(_peer_string(("::1", 5)))
    assert peer_key("ipv4:127.0.0.1:7") == ("127.0.0.1", 7) and peer_key("unix:/x") == "unix:/x"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard counts sockets in /proc/self/fd")
def test_an_ipv6_sweep_keeps_the_admitted_connection_named_as_grpc_names_it():
    from types import SimpleNamespace

    from fedcore.comm.sessions import CallAdmission
    try:
        listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    dialled = [socket.create_connection(listener.getsockname()[:2]) for _ in range(5)]
    accepted = [listener.accept()[0] for _ in dialled]
    # the accepted ends' peers are five connections from ::1, over a cap of 2; the last one
    # (the highest descriptor, the first the sweep would close) was admitted, recorded under
    # the peer string gRPC 1.85 gives it (brackets escaped)
    host, port = dialled[-1].getsockname()[:2]
    peer = f"ipv6:%5B{host}%5D:{port}"   # client 1's live session is on it
    sessions = SimpleNamespace(_admitted_peers={peer_key(peer): {1}}, _lock=threading.Lock(),
                               sessions={1: SimpleNamespace(state="live", peer=peer)})
    sessions._in_use = lambda key, ids: CallAdmission._in_use(sessions, key, ids)
    guard = ConnectionGuard(_Loop(), lambda peer: CallAdmission._admitted_on(sessions, peer), per_address=2)
    guard._sweep()
    assert not _closed(dialled[-1])                   # the admitted connection is kept
    assert all(_closed(s) for s in dialled[:-1])       # the others beyond the cap are closed
    for s in dialled + accepted + [listener]:
        s.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard counts sockets in /proc/self/fd")
def test_a_descriptor_reused_since_the_scan_is_left_alone_and_tls_gets_no_plaintext_goaway():
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    server_end = listener.accept()[0]
    guard = ConnectionGuard(_Loop(), lambda peer: False, goaway=False)
    # the descriptor now holds another peer than the one scanned: not written, not shut
    assert not guard._shut(("127.0.0.1", 1), server_end.fileno())
    assert not _closed(a)
    # the right peer: shut down, and without TLS access no bytes are written into its stream
    said = []
    assert guard._shut(server_end.getpeername()[:2], server_end.fileno())
    assert _closed(a, said) and said == [b""]
    for s in (a, server_end, listener):
        s.close()


def test_admissions_churned_by_a_token_holder_never_push_out_a_live_sessions_connection():
    """The server remembers the connections sessions were admitted on, the oldest forgotten
    beyond 4 x num_clients + 1024. A token holder admitted again and again as one id on new
    connections (each session ending) must not make an honest client's older connection
    look unused, or the per-address sweep would close it."""
    from types import SimpleNamespace

    from fedcore.comm.sessions import CallAdmission

    honest = "ipv4:127.0.0.1:40000"
    sessions = SimpleNamespace(_admitted_peers={}, _lock=threading.Lock(), num_clients=3,
                               sessions={1: SimpleNamespace(state="live", peer=honest)})
    remember = lambda key, cid: CallAdmission._remember_admission(sessions, key, cid)  # noqa: E731
    sessions._in_use = lambda key, ids: CallAdmission._in_use(sessions, key, ids)
    remember(peer_key(honest), 1)
    bound = 4 * 3 + 1024
    for port in range(41000, 41000 + 3 * bound):   # id 3 admitted, then gone, on each connection
        peer = f"ipv4:127.0.0.1:{port}"
        sessions.sessions[3] = SimpleNamespace(state="live", peer=peer)
        remember(peer_key(peer), 3)
        sessions.sessions[3].state = "left"
    assert len(sessions._admitted_peers) == bound              # still bounded
    assert CallAdmission._admitted_on(sessions, honest)         # the honest connection is known
    sessions.sessions[1].state = "lost"                         # once its session ends ...
    for port in range(50000, 50000 + bound):
        remember(peer_key(f"ipv4:127.0.0.1:{port}"), 3)
    assert peer_key(honest) not in sessions._admitted_peers    # ... it is forgotten like the rest


class _RecordingLoop(_Loop):
    def __init__(self):
        super().__init__()
        self.soon = []

    def call_soon(self, fn, *args):
        self.soon.append((fn, args))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard counts sockets in /proc/self/fd")
def test_a_connection_of_4_streams_has_its_first_refusal_answered_the_next_four_held_and_is_closed_at_the_sixth():
    # Held calls keep the connection's stream slots taken, so gRPC refuses its further calls
    # in the transport; a 6th refused call means its calls end anyway: closed at once. A
    # connection a live session uses is never held nor closed.
    from fedcore.comm.connections import CLOSE_AFTER
    admitted = {"ipv4:127.0.0.1:2"}
    guard = ConnectionGuard(_RecordingLoop(), lambda peer: peer in admitted, streams=4)
    peer = "ipv4:127.0.0.1:1"
    held = [guard.refused(peer) for _ in range(6)]
    assert held == [False, True, True, True, True, False]
    assert [d for d, _ in guard.loop.later] == [CLOSE_AFTER]    # closed CLOSE_AFTER after the first...
    assert [args for _, args in guard.loop.soon] == [(peer,)]    # ...or at once, at the 6th
    assert guard.closing(peer)
    assert [guard.refused("ipv4:127.0.0.1:2") for _ in range(3)] == [False] * 3
    assert not guard.closing("ipv4:127.0.0.1:2")


def _guard_on(loop, streams=4):
    guard = ConnectionGuard(loop, lambda peer: False, streams=streams)
    guard.enabled = True     # no descriptor is looked up in these tests: closes are only recorded
    closes = []
    guard._close = closes.append
    return guard, closes


def test_a_held_call_reset_by_its_sender_closes_its_connection_at_once():
    # Rapid reset: whatever the connection's stream limit, its first reset held call closes it
    # (the old rule waited for its 4th refusal; counting up to its slots would wait for 318
    # with 100 clients' default limit).
    import asyncio

    async def main():
        guard, closes = _guard_on(asyncio.get_running_loop(), streams=318)
        peer = "ipv4:10.0.0.9:5"
        assert guard.refused(peer) is False and guard.refused(peer) is True
        call = asyncio.ensure_future(guard.hold(peer))
        await asyncio.sleep(0.01)
        call.cancel()                       # the sender reset it
        await asyncio.gather(call, return_exceptions=True)
        await asyncio.sleep(0)
        return closes, guard.closing(peer), guard.held
    closes, closing, held = asyncio.run(main())
    assert closes == ["ipv4:10.0.0.9:5"] and closing and held == 0


def test_calls_beyond_the_held_pool_close_their_connection_at_once():
    # Past HELD_MAX held calls a refused call cannot be held: its connection is closed at
    # once, as the guard did before it held calls, not left to flood until CLOSE_AFTER.
    import asyncio
    from fedcore.comm.connections import HELD_MAX

    async def main():
        guard, closes = _guard_on(asyncio.get_running_loop(), streams=HELD_MAX + 8)
        first = "ipv4:10.0.0.1:1"
        assert not guard.refused(first)
        holds = [asyncio.ensure_future(guard.hold(first)) for _ in range(HELD_MAX) if guard.refused(first)]
        await asyncio.sleep(0.01)
        assert len(holds) == HELD_MAX and guard.held == HELD_MAX
        other = "ipv4:10.0.0.2:1"
        answered = [guard.refused(other), guard.refused(other)]
        await asyncio.sleep(0)
        for h in holds:
            h.cancel()
        await asyncio.gather(*holds, return_exceptions=True)
        return answered, closes
    answered, closes = asyncio.run(main())
    assert answered == [False, False] and closes[0] == "ipv4:10.0.0.2:1"


def test_held_calls_end_when_cancelled_and_no_more_than_held_max_are_held():
    import asyncio
    from fedcore.comm.connections import HELD_MAX, HOLD_FOR

    async def main():
        guard = ConnectionGuard(asyncio.get_running_loop(), lambda peer: False)
        holds = [asyncio.ensure_future(guard.hold("ipv4:10.0.0.3:1")) for _ in range(HELD_MAX + 3)]
        await asyncio.sleep(0.05)
        # the calls beyond HELD_MAX were answered at once; the others wait for their close
        assert sum(h.done() for h in holds) == 3 and guard.held == HELD_MAX
        for h in holds:
            h.cancel()   # their connection closed: gRPC cancels the calls
        await asyncio.gather(*holds, return_exceptions=True)
        assert guard.held == 0
        started = asyncio.get_running_loop().time()
        await guard.hold("ipv4:10.0.0.3:1")   # a connection that outlives its close: answered after HOLD_FOR
        return asyncio.get_running_loop().time() - started

    assert HOLD_FOR - 0.01 <= asyncio.run(main()) < HOLD_FOR + 1.0
