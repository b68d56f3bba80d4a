"""Reconnection, in process on loopback: a client's stream breaks, it redials and carries on."""
import threading
import time

import torch

from fedcore.comm.grpc_client import GrpcClientComm
from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.kernel.message import Message
from fedcore.kernel.scheduler import ImmediateScheduler
from tests.conftest import small_cfg


class _Recorder:
    def __init__(self):
        self.handlers = type("T", (), {"entries": {"receiving_note": None, "receiving_join_in": None}})()
        self.got = []
        self.finished = False
        self.cond = threading.Condition()

    def deliver(self, msg):
        with self.cond:
            self.got.append(msg.content)
            self.cond.notify_all()

    def wait(self, n, timeout=60):
        with self.cond:
            return self.cond.wait_for(lambda: len(self.got) >= n, timeout)


def _cfg(role, **kw):
    return small_cfg(None, federate__mode="distributed", federate__client_num=2, distribute__role=role,
                     distribute__insecure=True, distribute__token="t",
                     distribute__heartbeat_interval=0.2, distribute__heartbeat_timeout=30.0,
                     distribute__backoff_initial=0.05, distribute__backoff_max=0.2, **kw)


def _server(port=0):
    comm = GrpcServerComm(_cfg("server", distribute__server_port=port), ImmediateScheduler(),
                          lambda *a: None, lambda *a: None)
    inbox = _Recorder()
    comm.attach(inbox)
    return comm, inbox, comm.start()


def test_a_session_expired_by_the_server_resumes_and_loses_no_message():
    server, at_server, port = _server()
    client = GrpcClientComm(_cfg("client", distribute__server_port=port, distribute__client_id=2), ImmediateScheduler())
    at_client = _Recorder()
    try:
        client.start()
        assert client.wait_welcome() == 2
        client.attach(at_client)
        server.send(Message("note", 0, (2,), 1, 0.0, {"n": 1}))
        assert at_client.wait(1)
        assert server.expire(0.0) == [(2, "no heartbeat for 0s (distribute.heartbeat_timeout)")]
        # The server ended that stream; the client hears the end and redials with the same session
        # at once, not after its own heartbeat timeout (30 s here), and is admitted afresh.
        # Messages on the new session must not be mistaken for ones already delivered.
        expired = time.monotonic()
        server.send(Message("note", 0, (2,), 1, 0.0, {"n": 2}))  # not connected: dropped
        deadline = time.monotonic() + 60
        while server.live_ids() != [2] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.live_ids() == [2] and server.sessions[2].streams == 1
        assert time.monotonic() - expired < 15, "the client waited out its heartbeat timeout"
        server.send(Message("note", 0, (2,), 2, 0.0, {"n": 3, "t": torch.arange(3)}))
        assert at_client.wait(2)
        assert [m["n"] for m in at_client.got] == [1, 3] and torch.equal(at_client.got[1]["t"], torch.arange(3))
        client.send(Message("note", 2, (0,), 2, 0.0, {"n": 4}))
        assert at_server.wait(1) and at_server.got == [{"n": 4}]
    finally:
        client.close()
        server.stop(0.2)


def test_a_restarted_server_is_noticed_and_the_client_joins_again():
    server, _, port = _server()
    client = GrpcClientComm(_cfg("client", distribute__server_port=port, distribute__client_id=1), ImmediateScheduler())
    rejoined = threading.Event()
    client.on_new_server = rejoined.set
    second = None
    try:
        client.start()
        assert client.wait_welcome() == 1
        client.attach(_Recorder())
        first_session = client.server_session
        server.stop(0.1)
        second, _, _ = _server(port)   # a new server process on the same address
        assert rejoined.wait(60)
        assert client.server_session != first_session and client.client_id == 1
    finally:
        client.close()
        server.stop(0.1)
        if second is not None:
            second.stop(0.1)


def _until(condition, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _join(client, cid):
    client.send(Message("join_in", cid, (0,), 0, 0.0, {"client_id": cid}))


def test_a_new_process_is_no_candidate_until_it_joins_and_its_session_comes_back_a_member():
    """`live_ids(joined)` is what the course samples from. A process is in it once its own
    join_in arrived, not on the strength of an earlier process's join under the same id (that
    one was sampled while it still built its course, missed its deadline and was benched).
    The same process back on its session id after the server lost it is a member at once,
    and its client hears a welcome from the same server again (`on_readmitted`: it joins again)."""
    server, at_server, port = _server()
    sessions = []
    server.on_new_session = lambda cid, returning: sessions.append((cid, returning))
    first = GrpcClientComm(_cfg("client", distribute__server_port=port, distribute__client_id=2), ImmediateScheduler())
    welcomed_again = []
    first.on_readmitted = lambda: welcomed_again.append(1)
    second = None
    try:
        first.start()
        assert first.wait_welcome() == 2
        first.attach(_Recorder())
        _until(lambda: sessions == [(2, False)], "the first process's session")
        assert server.live_ids() == [2] and server.live_ids({2}) == []   # connected, not joined
        _join(first, 2)
        assert at_server.wait(1) and at_server.got == [{"client_id": 2}]
        assert server.live_ids({2}) == [2] and server.live_ids(set()) == []
        assert welcomed_again == []

        assert [cid for cid, _ in server.expire(0.0)] == [2]   # silent (as while building, say)
        assert server.live_ids({2}) == []
        _until(lambda: len(sessions) == 2, "the same process back")
        assert sessions[1] == (2, True)
        assert server.live_ids({2}) == [2]             # a member again, before any join
        _until(lambda: welcomed_again == [1], "the client to hear the same server again")
        _join(first, 2)                                 # what a course's client does then
        first.send(Message("note", 2, (0,), 5, 0.0, {"n": 1}))
        assert at_server.wait(2) and at_server.got == [{"client_id": 2}, {"n": 1}]   # the repeat unseen

        first.close()                                   # goodbye: its session ends
        _until(lambda: server.live_ids() == [], "the first process to leave")
        second = GrpcClientComm(_cfg("client", distribute__server_port=port, distribute__client_id=2),
                                ImmediateScheduler())
        second.start()
        assert second.wait_welcome() == 2
        second.attach(_Recorder())
        _until(lambda: len(sessions) == 3, "the second process's session")
        assert sessions[2] == (2, False)
        assert server.live_ids() == [2] and server.live_ids({2}) == []   # the first one's join is not its own
        assert server.live_ids({2}, joining=True) == [2]   # what a finished course tells it is over
        _join(second, 2)
        assert at_server.wait(3) and at_server.got[-1] == {"client_id": 2}
        assert server.live_ids({2}) == [2]
    finally:
        first.close()
        if second is not None:
            second.close()
        server.stop(0.2)
