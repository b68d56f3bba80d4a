"""A hostile participant written only from `proto/fedcore.proto` (it imports nothing of fedcore).

The protocol's Python classes are generated from the .proto at test time with
grpc_tools, into a folder of their own; everything else (chunking, hashing,
tensors, the call metadata) is written here from the .proto's comments, as an
outsider would write it. `Hostile` holds one stream and can join, read the
server's messages and send whatever it likes.
"""
from __future__ import annotations

import hashlib
import importlib
import queue
import struct
import sys
import threading
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
METHOD = "/fedcore.Fedcore/Connect"


def load_proto(folder: Path):
    """Compile proto/fedcore.proto into `folder` and import it (as `hostile_fedcore_pb2`); the
    calling test skips without grpc_tools (the dev extra)."""
    from tests.conftest import need_extra
    protoc = need_extra("dev", "grpc_tools.protoc")
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "hostile_fedcore.proto"
    # Another package name, so these classes can live beside fedcore's own in one process (the
    # wire carries no package names; the RPC's path is written out below).
    text = (ROOT / "proto" / "fedcore.proto").read_text()
    assert text.count("package fedcore;") == 1
    src.write_text(text.replace("package fedcore;", "package hostile;"))
    rc = protoc.main(["protoc", f"-I{folder}", f"--python_out={folder}", str(src)])
    assert rc == 0, "protoc failed"
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module("hostile_fedcore_pb2")
    finally:
        sys.path.remove(str(folder))


def _value(pb, obj):
    """A Python object (None, bool, int, float, str, bytes, list, dict, (dtype, shape, bytes)) as a Value."""
    v = pb.Value()
    if obj is None:
        v.none = True
    elif isinstance(obj, bool):
        v.b = obj
    elif isinstance(obj, int):
        v.i = obj
    elif isinstance(obj, float):
        v.f = obj
    elif isinstance(obj, str):
        v.s = obj
    elif isinstance(obj, bytes):
        v.raw = obj
    elif isinstance(obj, Tensor):
        v.tensor.dtype, v.tensor.data = obj.dtype, obj.data
        v.tensor.shape.extend(obj.shape)
    elif isinstance(obj, list):
        v.list.SetInParent()
        for item in obj:
            v.list.items.append(_value(pb, item))
    elif isinstance(obj, dict):
        v.map.SetInParent()
        for k, item in obj.items():
            e = v.map.entries.add()
            e.key = k
            e.value.CopyFrom(_value(pb, item))
    else:
        raise TypeError(type(obj))
    return v


class Tensor:
    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape, data: bytes):
        self.dtype, self.shape, self.data = dtype, list(shape), data

    @staticmethod
    def full(shape, value: float) -> "Tensor":
        n = 1
        for d in shape:
            n *= d
        return Tensor("float32", shape, struct.pack("<f", value) * n)

    def floats(self) -> list[float]:
        return list(struct.unpack(f"<{len(self.data) // 4}f", self.data))


def _python(pb, v):
    kind = v.WhichOneof("kind")
    if kind == "none":
        return None
    if kind in ("b", "i", "f", "s", "raw"):
        return getattr(v, kind)
    if kind == "tensor":
        return Tensor(v.tensor.dtype, v.tensor.shape, v.tensor.data)
    if kind == "list":
        return [_python(pb, x) for x in v.list.items]
    return {e.key: _python(pb, e.value) for e in v.map.entries}


class Hostile:
    """One stream to the server under a chosen id, token and session."""

    def __init__(self, pb, port: int, client_id: int, token: str, session: str = "hostile",
                 course: str | None = None, own_connection: bool = False):
        self.pb = pb
        # channels to one address share their connection unless each has its own subchannel pool
        own = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 64 * 2 ** 20), ("grpc.max_send_message_length", 64 * 2 ** 20),
            *own])
        self.md = [("fedcore-client-id", str(client_id)), ("fedcore-session", session),
                   ("authorization", f"Bearer {token}")]
        if course is not None:
            self.md.append(("fedcore-course", course))
        self.client_id = client_id
        self.out: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.next_id = 1
        self.status: grpc.StatusCode | None = None
        self.details = ""
        self._buf: dict[int, bytearray] = {}
        self.welcomed = threading.Event()   # the server's welcome came: the call was admitted
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Hostile":
        self._thread.start()
        return self

    def _requests(self):
        while True:
            frame = self.out.get()
            if frame is None:
                return
            yield frame

    def _run(self) -> None:
        rpc = self.channel.stream_stream(METHOD)
        try:
            for raw in rpc(self._requests(), metadata=self.md):
                self._on_frame(raw)
            self.status = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.status, self.details = exc.code(), exc.details() or ""
        self.inbox.put(None)

    def _on_frame(self, raw: bytes) -> None:
        frame = self.pb.Frame.FromString(raw)
        if frame.WhichOneof("kind") == "welcome":
            self.welcomed.set()
        if frame.WhichOneof("kind") != "chunk":
            return
        c = frame.chunk
        buf = self._buf.setdefault(c.message_id, bytearray())
        buf += c.data
        if len(buf) == c.total_size:
            env = self.pb.Envelope.FromString(bytes(self._buf.pop(c.message_id)))
            self.inbox.put((env.msg_type, env.round, _python(self.pb, env.content)))

    def wait_for(self, msg_type: str, timeout: float = 120.0):
        """The next message of `msg_type` (others are skipped); None if the stream ended."""
        while True:
            item = self.inbox.get(timeout=timeout)
            if item is None or item[0] == msg_type:
                return item

    def send(self, msg_type: str, round_: int, content, chunk: int = 1 << 20) -> None:
        env = self.pb.Envelope(msg_type=msg_type, sender=self.client_id, receivers=[0], round=round_)
        env.content.CopyFrom(_value(self.pb, content))
        self.send_raw(env.SerializeToString(), chunk)

    def send_raw(self, data: bytes, chunk: int = 1 << 20, total: int | None = None) -> None:
        """`data` as one message of `total` announced bytes (default: its length), in chunks."""
        mid, self.next_id = self.next_id, self.next_id + 1
        sha = hashlib.sha256(data).digest()
        for off in range(0, max(len(data), 1), chunk):
            c = self.pb.Chunk(message_id=mid, offset=off, total_size=total or len(data),
                              data=data[off:off + chunk], sha256=sha if off == 0 else b"")
            self.out.put(self.pb.Frame(chunk=c).SerializeToString())

    def heartbeat(self) -> None:
        self.out.put(self.pb.Frame(heartbeat=self.pb.Heartbeat(sent_at=0.0)).SerializeToString())

    def close(self) -> None:
        self.out.put(None)
        self._thread.join(10)
        self.channel.close()
