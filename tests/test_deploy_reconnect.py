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
        self.handlers = type("T", (), {"entries": {"receiving_note": None}})()
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
