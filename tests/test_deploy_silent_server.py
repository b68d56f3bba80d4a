"""A client whose call never hears from its server: the call is cancelled and redialed.

The fake server is a listener that completes TCP connections and never speaks HTTP/2 (a
server hung before its gRPC started, or a port another program holds). gRPC then holds the
client's call with no stream under it, so none of the client's writes completes: a silence
watch that ran only between writes would never fire (gRPC itself gives up on such a connection
only after 20 s, and a call left pending by a server going down may wait for ever).
"""
import logging
import socket
import threading

import pytest

from fedcore.comm.grpc_client import GrpcClientComm, ServerUnreachable
from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.kernel.scheduler import ImmediateScheduler
from tests.conftest import small_cfg

HB_TIMEOUT = 0.5
NO_WELCOME = f"no welcome from the server within {HB_TIMEOUT:g}s"


def _cfg(role, **kw):
    return small_cfg(None, federate__mode="distributed", federate__client_num=2, distribute__role=role,
                     distribute__insecure=True, distribute__token="t",
                     distribute__heartbeat_interval=0.1, distribute__heartbeat_timeout=HB_TIMEOUT,
                     distribute__backoff_initial=0.05, distribute__backoff_max=0.2, **kw)


class _Mute:
    """Accepts TCP connections on a loopback port and never sends or reads a byte."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.redialed = threading.Event()   # a second connection came
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:   # closed
                return
            if len(self.conns) >= 2:
                self.redialed.set()

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes the accepting thread: the port is free
        except OSError:   # closed already
            pass
        self.sock.close()
        for c in self.conns:
            c.close()


class _NoHandlers:
    """A server's worker that takes no message: admission alone is under test."""

    handlers = type("Handlers", (), {"entries": {}})()

    def deliver(self, msg):
        raise AssertionError(f"no message was sent, yet {msg.msg_type} arrived")


class _Lines(logging.Handler):
    """The fedcore.deploy log lines, and an event set at the first that holds `text`."""

    def __init__(self, text: str):
        super().__init__(logging.WARNING)
        self.text, self.lines, self.seen = text, [], threading.Event()

    def emit(self, record):
        line = record.getMessage()
        self.lines.append(line)
        if self.text in line:
            self.seen.set()


@pytest.fixture
def lines():
    handler = _Lines(NO_WELCOME + "; reconnecting")
    log = logging.getLogger("fedcore.deploy")
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)


def test_a_call_with_no_connection_under_it_is_cancelled_and_the_client_joins_the_server_that_comes(lines):
    mute = _Mute()
    port = mute.port
    client = GrpcClientComm(_cfg("client", distribute__server_port=port, distribute__client_id=2,
                                 distribute__retry_timeout=120.0), ImmediateScheduler())
    server = None
    try:
        client.start()
        assert lines.seen.wait(60), f"the client never gave up its unanswered call: {lines.lines[-3:]}"
        assert client.client_id is None and not client.connected
        mute.close()
        # the real server on the same address: the client, still redialing, is admitted
        server = GrpcServerComm(_cfg("server", distribute__server_port=port), ImmediateScheduler(),
                                lambda *a: None, lambda *a: None)
        server.attach(_NoHandlers())
        assert server.start() == port
        done = threading.Thread(target=client.wait_welcome, daemon=True)
        done.start()
        done.join(60)
        assert not done.is_alive() and client.fatal is None and client.client_id == 2
    finally:
        client.close()
        mute.close()
        if server is not None:
            server.stop(0.1)


def _given_up(client, hung: str) -> list:
    """Start `client` and wait (60 s at most, else fail saying `hung`) for its wait for the
    welcome to end: the ServerUnreachable it raised, in a list."""
    client.scheduler.call_soon = lambda action: None   # no course to raise the failure into
    raised = []

    def wait():
        try:
            client.wait_welcome()
        except ServerUnreachable as exc:
            raised.append(exc)
    client.start()
    ended = threading.Thread(target=wait, daemon=True)
    ended.start()
    ended.join(60)
    assert not ended.is_alive(), hung
    return raised


def test_a_server_that_never_answers_counts_against_retry_timeout(lines):
    mute = _Mute()
    client = GrpcClientComm(_cfg("client", distribute__server_port=mute.port, distribute__client_id=1,
                                 distribute__retry_timeout=3.0), ImmediateScheduler())
    try:
        raised = _given_up(client, "the client waited on a server that never answered")
        assert raised == [client.fatal] and client.fatal.exit_code == 4
        # given up on for its silence (gRPC's own connect timeout, 20 s, never came into it)
        assert "retry_timeout=3" in str(client.fatal) and f"last error: {NO_WELCOME}" in str(client.fatal)
        assert sum(NO_WELCOME + "; reconnecting" in line for line in lines.lines) >= 2   # it redialed
        # each time on a new connection: the client has ended, so these are all it ever opened
        # (gRPC, left to itself, keeps waiting 20 s on the one connection that never answers)
        assert mute.redialed.wait(60), f"{len(mute.conns)} connection for every redial"
    finally:
        client.close()
        mute.close()



def test_a_welcoming_server_that_falls_silent_is_redialed_and_welcomes_the_client_back():
    """The project's own server, its event loop frozen after the welcome (a stopped process):
    the connection stays up, the client's writes still complete, and the server says nothing."""
    server = GrpcServerComm(_cfg("server", distribute__server_port=0), ImmediateScheduler(),
                            lambda *a: None, lambda *a: None)
    server.attach(_NoHandlers())
    port = server.start()
    client = GrpcClientComm(_cfg("client", distribute__server_port=port, distribute__client_id=2,
                                 distribute__retry_timeout=120.0), ImmediateScheduler())
    silent = _Lines(f"server silent for {HB_TIMEOUT:g}s (distribute.heartbeat_timeout); reconnecting")
    logging.getLogger("fedcore.deploy").addHandler(silent)
    readmitted, thaw = threading.Event(), threading.Event()
    client.on_readmitted = readmitted.set
    try:
        client.start()
        assert client.wait_welcome() == 2
        first = client.server_session
        server._on_loop(thaw.wait)   # the server's loop runs nothing until thawed
        assert silent.seen.wait(60), f"the client never noticed its server's silence: {silent.lines[-3:]}"
        thaw.set()
        assert readmitted.wait(60), "the client was not welcomed back"
        assert client.server_session == first and client.client_id == 2 and client.fatal is None
    finally:
        thaw.set()
        logging.getLogger("fedcore.deploy").removeHandler(silent)
        client.close()
        server.stop(0.1)


class _WedgedCall:
    """A call as gRPC leaves one now and then: no response, and cancelling it does not end it
    (its receive never completes). Released at the test's end."""

    def __init__(self, released: threading.Event):
        self.released, self.cancelled = released, False

    def __iter__(self):
        return self

    def __next__(self):
        self.released.wait()
        raise StopIteration

    def cancel(self):
        self.cancelled = True
        return True


class _WedgingClient(GrpcClientComm):
    """The project's client with one stage changed: every call it makes is wedged."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.released, self.calls, self.channels = threading.Event(), [], 0

    def _channel(self):
        self.channels += 1
        client = self

        class Channel:
            def stream_stream(self, method):
                def connect(requests, metadata):
                    client.calls.append(_WedgedCall(client.released))
                    return client.calls[-1]
                return connect

            def close(self):
                pass
        return Channel()


def test_a_cancelled_call_that_never_ends_is_left_behind_and_counts_against_retry_timeout(lines):
    client = _WedgingClient(_cfg("client", distribute__server_port=1, distribute__client_id=1,
                                 distribute__retry_timeout=3.0), ImmediateScheduler())
    try:
        raised = _given_up(client, "the client waited for ever on a call it had cancelled")
        assert raised == [client.fatal] and f"last error: {NO_WELCOME}" in str(client.fatal)
        # every call was cancelled and left behind, each redial on a new channel
        assert len(client.calls) >= 2 and all(c.cancelled for c in client.calls)
        assert client.channels == len(client.calls)
    finally:
        client.released.set()
        client.close()
