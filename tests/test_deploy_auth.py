"""Admission: shared and per-client tokens, id assignment, refusals (in-process server, loopback)."""
import grpc
import pytest

from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.comm.stream import MD_CLIENT_ID, MD_SESSION, MD_TOKEN, METHOD, bye_frame
from fedcore.wire import fedcore_pb2 as pb
from tests.conftest import small_cfg


class _Now:
    now = 0.0

    def call_soon(self, action, priority=1):
        action()


class _Server:
    id = 0
    handlers = type("T", (), {"entries": {"receiving_join_in": None}})()

    def deliver(self, msg):
        pass


@pytest.fixture
def serve():
    started = []

    def start(**kw):
        cfg = small_cfg(None, federate__mode="distributed", federate__client_num=3,
                        distribute__role="server", distribute__server_port=0,
                        distribute__insecure=True, **kw)
        comm = GrpcServerComm(cfg, _Now(), lambda *a: None, lambda *a: None)
        comm.attach(_Server())
        port = comm.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append((comm, channel))
        return comm, channel.stream_stream(METHOD)
    yield start
    for comm, channel in started:
        channel.close()
        comm.stop(0.2)


def _join(rpc, token, client="0", session="s"):
    """Open a stream, read the welcome, say goodbye; returns (status, assigned id)."""
    md = [(MD_CLIENT_ID, client), (MD_SESSION, session)]
    if token is not None:
        md.append((MD_TOKEN, f"Bearer {token}"))
    assigned = None
    try:
        for raw in rpc(iter([bye_frame("test")]), metadata=md, timeout=20):
            frame = pb.Frame.FromString(raw)
            if frame.WhichOneof("kind") == "welcome":
                assigned = frame.welcome.client_id
        return grpc.StatusCode.OK, assigned
    except grpc.RpcError as exc:
        return exc.code(), assigned


def test_shared_token_admits_and_assigns_the_lowest_free_id(serve):
    comm, rpc = serve(distribute__token="shared")
    assert _join(rpc, "shared", client="2") == (grpc.StatusCode.OK, 2)
    assert _join(rpc, "shared", session="a") == (grpc.StatusCode.OK, 1)  # 2 has left: 1 is lowest free
    assert _join(rpc, "wrong", client="1")[0] == grpc.StatusCode.UNAUTHENTICATED
    assert _join(rpc, None, client="1")[0] == grpc.StatusCode.UNAUTHENTICATED
    assert _join(rpc, "shared", client="4")[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert _join(rpc, "shared", client="one")[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert comm.sessions[1].state == "left" and comm.sessions[2].state == "left"


def test_per_client_tokens_bind_a_token_to_its_id(serve):
    comm, rpc = serve(distribute__tokens={1: "token-one", 3: "token-three"})
    assert _join(rpc, "token-three") == (grpc.StatusCode.OK, 3)          # the token names the client
    assert _join(rpc, "token-one", client="1") == (grpc.StatusCode.OK, 1)
    assert _join(rpc, "token-one", client="3")[0] == grpc.StatusCode.UNAUTHENTICATED
    assert _join(rpc, "token-two", client="2")[0] == grpc.StatusCode.UNAUTHENTICATED  # 2 has no token
    assert _join(rpc, "nobody's")[0] == grpc.StatusCode.UNAUTHENTICATED


def test_a_second_session_for_a_live_id_is_refused_not_swapped_in(serve):
    comm, rpc = serve(distribute__token="shared")
    md = [(MD_CLIENT_ID, "2"), (MD_SESSION, "first"), (MD_TOKEN, "Bearer shared")]
    first = rpc(_forever(), metadata=md)
    assert pb.Frame.FromString(next(first)).welcome.client_id == 2  # the live session
    code, _ = _join(rpc, "shared", client="2", session="second")
    assert code == grpc.StatusCode.ALREADY_EXISTS and comm.sessions[2].session_id == "first"
    assert comm.refusals() == {"second session for a live id": 1}
    first.cancel()


def _forever():
    import time
    while True:
        time.sleep(0.2)
        yield from ()


def test_course_fingerprint_names_the_keys_that_differ_and_not_their_values():
    from fedcore.comm.fingerprint import differing_keys, fingerprint
    server = small_cfg(None, model__type="mlp")
    same = fingerprint(small_cfg(None, model__type="mlp", train__batch_size=7))  # local training may differ
    assert differing_keys(server, same) == []
    other = fingerprint(small_cfg(None, model__type="logreg", model__dtype="float64"))
    assert differing_keys(server, other) == ["model.dtype", "model.type"]   # names, never our values
    own = small_cfg(None, model__type="mlp", distribute__own_data=True, data__synthetic__dim=5, seed=3)
    assert differing_keys(server, fingerprint(own)) == []  # a client's own data defines itself
    # the privacy the server reports is that of the configured mechanism: a client started
    # without the local noise (or with another) is refused, as a wrong model is
    noisy = small_cfg(None, model__type="mlp", privacy__dp__mode="local", privacy__dp__noise_multiplier=2.0)
    assert differing_keys(noisy, fingerprint(server)) == ["privacy.dp.mode", "privacy.dp.noise_multiplier"]
    assert differing_keys(noisy, fingerprint(small_cfg(None, model__type="mlp", privacy__dp__mode="local",
                                                       privacy__dp__noise_multiplier=0.5))) == \
        ["privacy.dp.noise_multiplier"]
