"""A hostile network: thousands of random, mutated and malformed inputs against a real server.

Each input goes on its own stream. Every malformed one must end its stream
with INVALID_ARGUMENT (random bytes may happen to be valid, so those may also
end OK); missing or wrong tokens get UNAUTHENTICATED; a frame above the gRPC
limit gets RESOURCE_EXHAUSTED. The server process must stay up throughout,
and two normal clients must then complete a course with it.
"""
import hashlib
import pickle
import random

import grpc
import pytest
import torch

from fedcore.comm.chunking import chunk_frames
from fedcore.comm.stream import MD_CLIENT_ID, MD_SESSION, MD_TOKEN, METHOD, heartbeat_frame
from fedcore.wire.serialization import encode_envelope
from fedcore.wire import fedcore_pb2 as pb
from tests.deploy_helpers import server_port, text, wait_exit, write_cfg

pytestmark = pytest.mark.slow

CHUNK = 64 * 1024
MAX_MESSAGE = 1024 * 1024
OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT


class Fuzzer:
    def __init__(self, port: int, own_connection: bool = False):
        # channels to one address share their connection unless each has its own subchannel pool
        own = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                             options=[("grpc.max_send_message_length", 4 * CHUNK), *own])
        self.rpc = self.channel.stream_stream(METHOD)
        self.next_id = 1
        self.sessions = 0

    def metadata(self, token="t", client="1", fresh=False):
        if fresh:
            self.sessions += 1
        md = [(MD_CLIENT_ID, client), (MD_SESSION, f"fuzz-{self.sessions}")]
        return md + ([(MD_TOKEN, f"Bearer {token}")] if token is not None else [])

    def status(self, frames, **md) -> grpc.StatusCode:
        try:
            for _ in self.rpc(iter(frames), metadata=self.metadata(**md), timeout=30):
                pass
            return OK
        except grpc.RpcError as exc:
            return exc.code()

    def message(self, env: bytes, size=CHUNK) -> list[bytes]:
        mid, self.next_id = self.next_id, self.next_id + 1
        return list(chunk_frames((env,), mid, size))


def _update(model, **extra):
    return encode_envelope("updates", 1, [0], 1, 0.5, {"model": model, "num_samples": 3, **extra})


def _bad_tensor(dtype="float32", shape=(3, 8), nbytes=10) -> bytes:
    env = pb.Envelope(msg_type="updates", sender=1, receivers=[0], round=1)
    entry = env.content.map.entries.add()
    entry.key = "model"
    w = entry.value.map.entries.add()
    w.key = "1.weight"
    w.value.tensor.dtype = dtype
    w.value.tensor.shape.extend(shape)
    w.value.tensor.data = bytes(nbytes)
    return env.SerializeToString()


def _deep(levels: int) -> bytes:
    """A join_in whose content is a list in a list in ... (written by hand: protobuf refuses to build it)."""
    def field(tag: int, body: bytes) -> bytes:
        n, size = len(body), bytearray()
        while True:
            size.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                break
        return bytes([tag]) + bytes(size) + body
    value = b"\x08\x01"                              # Value{none: true}
    for _ in range(levels):
        value = field(0x42, field(0x0A, value))       # Value{list: ValueList{items: [value]}}
    head = pb.Envelope(msg_type="join_in", sender=1, receivers=[0]).SerializeToString()
    return head + field(0x3A, value)


def _malformed(f: Fuzzer) -> dict[str, list[bytes]]:
    good_model = {"1.weight": torch.zeros(3, 8), "1.bias": torch.zeros(3)}
    big = bytes(range(256)) * 1024  # 256 KiB: four chunks
    two = f.message(big)
    a, b = f.message(big), f.message(big)
    wrong_hash = f.message(big)
    first = pb.Frame.FromString(wrong_hash[0])
    first.chunk.sha256 = hashlib.sha256(b"something else").digest()
    wrong_hash[0] = first.SerializeToString()
    announced = pb.Frame(chunk=pb.Chunk(message_id=f.next_id, offset=0, total_size=MAX_MESSAGE + 1,
                                        sha256=bytes(32), data=b"x")).SerializeToString()
    pickled = pickle.dumps({"model": torch.zeros(3)})
    return {
        "unknown message type": f.message(encode_envelope("launch", 1, [0], 1, 0.0, {})),
        "empty message type": f.message(encode_envelope("", 1, [0], 1, 0.0, {})),
        "spoofed sender": f.message(encode_envelope("join_in", 2, [0], 0, 0.0, {"client_id": 2})),
        "receiver not the server": f.message(encode_envelope("join_in", 1, [0, 2], 0, 0.0, None)),
        "tensor bytes do not fit its shape": f.message(_bad_tensor()),
        "tensor dtype not allowed": f.message(_bad_tensor(dtype="object", nbytes=96)),
        "negative dimension": f.message(_bad_tensor(shape=(-3, 8), nbytes=0)),
        "update of the wrong shape": f.message(_update({"1.weight": torch.zeros(8, 3),
                                                       "1.bias": torch.zeros(3)})),
        "update of the wrong dtype": f.message(_update({"1.weight": torch.zeros(3, 8, dtype=torch.float64),
                                                       "1.bias": torch.zeros(3)})),
        "update missing an entry": f.message(_update({"1.weight": torch.zeros(3, 8)})),
        "update with NaN": f.message(_update({"1.weight": torch.full((3, 8), float("nan")),
                                             "1.bias": torch.zeros(3)})),
        "update without a model": f.message(encode_envelope("updates", 1, [0], 1, 0.0, {"num_samples": 3})),
        "update as a string": f.message(encode_envelope("updates", 1, [0], 1, 0.0, "model")),
        "update with a bool sample count": f.message(encode_envelope(
            "updates", 1, [0], 1, 0.0, {"model": good_model, "num_samples": True})),
        "metrics that are not numbers": f.message(encode_envelope("metrics", 1, [0], 1, 0.0, {"acc": "x"})),
        "pickle inside join_in": f.message(encode_envelope("join_in", 1, [0], 0, 0.0,
                                                           {"client_id": 1, "payload": pickled})),
        "pickle as the envelope": f.message(pickled),
        "pickle as the frame": [pickled],
        "content nested too deep": f.message(_deep(120)),
        "frame of no known kind": [b""],
        "a client's welcome frame": [pb.Frame(welcome=pb.Welcome(client_id=1)).SerializeToString()],
        "message above max_message_bytes": [announced],
        "chunk above chunk_size": f.message(big[:100_000], size=100_000),
        "truncated message": a[:2] + b,
        "chunk out of order": [two[0], two[2]],
        "stream ends inside a message": two[:3],
        "integrity check fails": wrong_hash,
    }


def test_server_rejects_thousands_of_bad_inputs_and_then_serves_a_course(tmp_path, procs):
    cfg = write_cfg(tmp_path / "course.yaml", {
        "federate.client_num": 2, "distribute.insecure": True, "distribute.token": "t",
        "distribute.chunk_size": CHUNK, "distribute.max_message_bytes": MAX_MESSAGE,
        "distribute.heartbeat_interval": 0.5, "distribute.heartbeat_timeout": 60.0})
    out = tmp_path / "out"
    server = procs.fedcore("server", cfg, "distribute.role=server", "distribute.server_port=0",
                           f"outdir={out}")
    port = server_port(out, server)
    f = Fuzzer(port)
    rng = random.Random(0)

    for name, frames in _malformed(f).items():
        assert f.status(frames, fresh=True) == INVALID, name
    # An outsider's refused calls come on a connection of its own: the server closes a connection
    # that brought refusals unless a live session uses it, and the fuzzing session below is
    # ended by nearly every message it sends (a call ending then would end UNAVAILABLE).
    outsider = Fuzzer(port, own_connection=True)
    assert outsider.status([heartbeat_frame()], token=None) == grpc.StatusCode.UNAUTHENTICATED
    assert outsider.status([heartbeat_frame()], token="wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert outsider.status([heartbeat_frame()], client="99") == INVALID
    outsider.channel.close()
    assert f.status([bytes(3 * CHUNK)]) == grpc.StatusCode.RESOURCE_EXHAUSTED  # above the gRPC limit
    assert server.poll() is None

    valid = [encode_envelope("join_in", 1, [0], 0, 0.0, {"client_id": 1}),
             _update({"1.weight": torch.ones(3, 8), "1.bias": torch.ones(3)}),
             encode_envelope("metrics", 1, [0], 1, 0.0, {"acc": 0.5, "loss": 1.0})]
    codes = {}
    for i in range(3000):
        kind = i % 3
        if kind == 0:    # random bytes as a frame
            frames = [rng.randbytes(rng.randrange(0, 160))]
        else:
            env = bytearray(rng.choice(valid))
            if kind == 1:  # a mutated envelope, framed and hashed correctly
                for _ in range(rng.randint(1, 4)):
                    env[rng.randrange(len(env))] = rng.randrange(256)
                if rng.random() < 0.3:
                    env = env[:rng.randrange(len(env))]
                frames = f.message(bytes(env))
            else:          # a correct envelope in a mutated frame
                frame = bytearray(f.message(bytes(env))[0])
                for _ in range(rng.randint(1, 3)):
                    frame[rng.randrange(len(frame))] = rng.randrange(256)
                frames = [bytes(frame[:rng.randrange(1, len(frame) + 1)])]
        code = f.status(frames)
        codes[code] = codes.get(code, 0) + 1
        assert code in (OK, INVALID), (i, code)
    assert codes.get(INVALID, 0) > 1000 and server.poll() is None
    f.channel.close()

    clients = [procs.fedcore(f"client{k}", cfg, "distribute.role=client",
                             f"distribute.server_port={port}",
                             f"distribute.client_id={k}") for k in (1, 2)]
    assert wait_exit(server, 240) == 0, text(server)[-3000:]
    assert all(wait_exit(c, 60) == 0 for c in clients)
    assert "refused a message" in text(server) and "unknown message type" in text(server)
