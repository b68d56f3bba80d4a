"""The fleet server: streams without threads, one encoding and one hash of a broadcast's content,
first chunks sized to the slowest link, and the asyncio outbox's ownership and delivery rules."""
import asyncio
import hashlib
import threading
import weakref
from pathlib import Path

import grpc
import pytest

from fedcore.comm.async_outbox import AsyncOutbox
from fedcore.comm.chunking import (FIRST_CHUNK, Reassembler, SharedContent, chunk_frames, envelope_parts,
                                   first_chunk_size)
from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.comm.stream import MD_CLIENT_ID, MD_SESSION, MD_TOKEN, METHOD, grpc_options, parse_frame
from fedcore.kernel.message import Message
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.codec import decode_envelope, encode_value, from_value
from tests.conftest import small_cfg

MB = 1024 * 1024


# ---------------------------------------------------------------- one encoding, one hash

def test_a_shared_content_envelope_is_the_header_first_one_in_another_field_order():
    content = encode_value({"w": list(range(50)), "tag": "model"})
    header = pb.Envelope(msg_type="models", sender=0, receivers=[1234], round=7, timestamp=1.5)
    parts, sha = SharedContent(content).envelope(header)
    joined = b"".join(parts)
    reference = b"".join(envelope_parts(header, content))
    assert sha == hashlib.sha256(joined).digest()
    assert len(joined) == len(reference)          # byte counts (and the simulation's) unchanged
    env = decode_envelope(joined)
    assert env == decode_envelope(reference)
    assert list(env.receivers) == [1234] and from_value(env.content)["tag"] == "model"


def test_each_receiver_gets_its_own_header_under_one_hash_of_the_content():
    shared = SharedContent(encode_value({"blob": b"x" * 100_000}))
    seen = set()
    for cid in (1, 2, 300):
        parts, sha = shared.envelope(pb.Envelope(msg_type="m", sender=0, receivers=[cid]))
        assert parts[1] is shared.content                 # the content is never copied
        assert sha == hashlib.sha256(b"".join(parts)).digest()
        seen.add(sha)
    assert len(seen) == 3


# ---------------------------------------------------------------- first chunks

def test_the_first_chunk_is_what_the_slowest_link_delivers_in_an_eighth_of_the_timeout():
    assert first_chunk_size(2 * MB, 10.0, 10_000.0) == FIRST_CHUNK       # the defaults: unchanged
    assert first_chunk_size(2 * MB, 120.0, 10_000.0) == 150_000
    assert first_chunk_size(64 * 1024, 3600.0, 1e6) == 64 * 1024        # never above a chunk


def test_a_message_within_the_first_chunk_travels_in_one_frame_and_reassembles():
    parts = envelope_parts(pb.Envelope(msg_type="updates", sender=3, receivers=[0]),
                           encode_value({"b": b"y" * 31_400}))
    first = first_chunk_size(2 * MB, 120.0, 10_000.0)
    frames = list(chunk_frames(parts, 9, 2 * MB, first))
    assert len(frames) == 1
    assert len(list(chunk_frames(parts, 9, 2 * MB, FIRST_CHUNK))) == 2
    reasm = Reassembler(10 * MB, 2 * MB)
    assert bytes(reasm.feed(parse_frame(frames[0], 3 * MB).chunk)) == b"".join(parts)


def test_a_broadcast_models_tensors_are_sent_from_where_they_lie():
    """Content given as pieces: a tensor of 1 MiB or more is a view of the tensor (a broadcast
    model costs no copy), the small pieces around it are joined, and the envelope is byte for
    byte the one encoded whole, under the SHA-256 of those bytes."""
    import torch
    from fedcore.comm.chunking import SHARED_PIECE
    from fedcore.wire.codec import encode_value_parts
    big = torch.arange(SHARED_PIECE // 4 + 3, dtype=torch.float32)
    content = {"model": {"w": big, "b": torch.ones(5)}, "num_samples": 7}
    header = pb.Envelope(msg_type="models", sender=0, receivers=[5], round=2)
    parts, sha = SharedContent(encode_value_parts(content)).envelope(header)
    joined = b"".join(parts)
    whole, whole_sha = SharedContent(encode_value(content)).envelope(header)
    assert joined == b"".join(whole) and sha == whole_sha
    assert sha == hashlib.sha256(joined).digest()
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 1 and views[0].nbytes == big.numel() * 4
    assert torch.frombuffer(views[0], dtype=torch.uint8).data_ptr() == big.data_ptr()   # no copy
    assert len(parts) == 5        # field, the pieces before the tensor's bytes, its bytes, the rest, header
    decoded = from_value(decode_envelope(joined).content)
    assert torch.equal(decoded["model"]["w"], big) and decoded["num_samples"] == 7


def test_a_clients_update_is_framed_from_its_tensors_and_decodes_as_sent():
    """A deployed client queues its update as pieces too: the large tensor's bytes are the
    tensor's own (no encoded copy of the update), and the frames it writes reassemble into
    the envelope that decodes to what it sent."""
    import torch
    from fedcore.comm.chunking import SHARED_PIECE
    from fedcore.comm.grpc_client import GrpcClientComm
    from fedcore.kernel.message import Message
    from tests.conftest import small_cfg
    cfg = small_cfg(None, federate__mode="distributed", distribute__role="client", distribute__insecure=True)
    comm = GrpcClientComm(cfg, object())
    big = torch.arange(SHARED_PIECE // 4 + 3, dtype=torch.float32)
    comm.send(Message("updates", 1, (0,), 3, 0.0, {"model": {"w": big, "b": torch.ones(2)}, "num_samples": 4}))
    (kind, mid, parts, sha), = comm.outbox._items
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 1 and torch.frombuffer(views[0], dtype=torch.uint8).data_ptr() == big.data_ptr()
    token = comm.outbox.claim()
    frames = comm.outbox.frames(token, lambda: True, 0.01, lambda: None)
    box = Reassembler(2 ** 30, comm.chunk_size)
    done = None
    for raw in frames:
        done = box.feed(parse_frame(raw, 2 ** 30).chunk) or done
        if done is not None:
            break
    env = decode_envelope(done)
    got = from_value(env.content)
    assert (env.msg_type, env.round, got["num_samples"]) == ("updates", 3, 4)
    assert torch.equal(got["model"]["w"], big) and torch.equal(got["model"]["b"], torch.ones(2))


# ---------------------------------------------------------------- the asyncio outbox

def _drain(box, token, n, interval=5.0, alive=lambda: True):
    """Up to `n` frames from `box` as the stream owning `token` would take them."""
    async def go():
        out = []
        gen = box.frames(token, alive, interval, lambda: b"heartbeat")
        async for frame in gen:
            out.append(frame)
            if len(out) == n:
                break
        await gen.aclose()
        return out
    return go


def _run(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(10)


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(5)
    lp.close()


def _chunks(frames):
    return [parse_frame(f, 3 * MB).chunk for f in frames]


def test_messages_queued_from_another_thread_arrive_in_order_and_wake_a_waiting_stream(loop):
    box = AsyncOutbox(1000, 400, iter(range(1, 100)), loop)
    token = _run(loop, _claim(box))
    waiting = asyncio.run_coroutine_threadsafe(_drain(box, token, 3)(), loop)
    box.put_message((b"a" * 900,))            # 900 bytes: a 400-byte first chunk, then 500
    box.put_message((b"b" * 10,))
    chunks = _chunks(waiting.result(10))
    assert [(c.message_id, c.offset, len(c.data)) for c in chunks] == [(1, 0, 400), (1, 400, 500), (2, 0, 10)]
    assert len(box) == 1     # the last frame was taken, but the stream has not asked for more


async def _claim(box):
    return box.claim()


def test_a_message_cut_short_stays_queued_whole_for_the_next_stream(loop):
    box = AsyncOutbox(1000, 400, iter(range(1, 100)), loop)
    box.put_message((b"a" * 900,))
    first = _run(loop, _claim(box))
    assert len(_run(loop, _drain(box, first, 1)())) == 1      # one of its two frames, then the stream broke
    assert len(box) == 1
    second = _run(loop, _claim(box))                            # the session's next stream takes over
    chunks = _chunks(_run(loop, _drain(box, second, 2)()))
    assert [(c.message_id, c.offset) for c in chunks] == [(1, 0), (1, 400)]
    assert _run(loop, _drain(box, first, 1)()) == []            # the old stream owns nothing now


def test_an_idle_stream_sends_heartbeats_and_ends_when_no_longer_alive(loop):
    box = AsyncOutbox(1000, 400, iter(range(1, 100)), loop)
    token = _run(loop, _claim(box))
    assert _run(loop, _drain(box, token, 2, interval=0.05)()) == [b"heartbeat", b"heartbeat"]
    assert _run(loop, _drain(box, token, 5, alive=lambda: False)()) == []


class _Bytes(bytearray):
    """Bytes a weak reference can watch."""


def test_a_sent_message_is_let_go_while_the_stream_waits_for_more(loop):
    """Neither outbox keeps what it sent alive while its stream idles: a broadcast model
    would otherwise stay in the server's memory, once per idle stream, until the next message."""
    from fedcore.comm.stream import Outbox
    box = AsyncOutbox(1000, 400, iter(range(1, 100)), loop)
    token = _run(loop, _claim(box))
    body = _Bytes(b"a" * 900)
    watch = weakref.ref(body)
    box.put_message((body,))
    del body

    async def two_frames_then_idle():
        gen = box.frames(token, lambda: True, 0.05, lambda: b"heartbeat")
        got = [await gen.__anext__() for _ in range(3)]   # the message's two frames, a heartbeat
        alive = watch() is not None                        # asked while the stream idles
        await gen.aclose()
        return got, alive
    got, alive = _run(loop, two_frames_then_idle())
    assert got[2] == b"heartbeat" and len(box) == 0 and not alive

    sync_box = Outbox(1000, first_size=400)
    body = _Bytes(b"b" * 900)
    watch = weakref.ref(body)
    sync_box.put_message((body,))
    del body
    frames = sync_box.frames(sync_box.claim(), lambda: True, 0.05, lambda: b"heartbeat")
    assert [next(frames) for _ in range(3)][2] == b"heartbeat"
    assert watch() is None and len(sync_box) == 0
    frames.close()


# ---------------------------------------------------------------- many streams, no threads

class _Inbox:
    id = 0
    handlers = type("T", (), {"entries": {"receiving_note": None}})()

    def __init__(self):
        self.got = []
        self.cond = threading.Condition()

    def deliver(self, msg):
        with self.cond:
            self.got.append((msg.sender, msg.content["n"]))
            self.cond.notify_all()


class _Now:
    now = 0.0

    def call_soon(self, action, priority=1):
        action()


def _threads() -> int:
    return int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("Threads:")))


async def _fleet(port, n, connected, broadcast_seen):
    """`n` protocol clients on one channel: each is welcomed, waits for the broadcast, checks
    it is addressed to itself, and answers with a note carrying its number."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_options(2 * MB, server=False))
    welcomed = asyncio.Event()
    count = [0]

    async def client(cid):
        out = asyncio.Queue()

        async def requests():
            while True:
                frame = await out.get()
                if frame is None:
                    return
                yield frame

        md = ((MD_CLIENT_ID, str(cid)), (MD_SESSION, f"s{cid}"), (MD_TOKEN, "Bearer fleet"))
        call = channel.stream_stream(METHOD)(requests(), metadata=md)
        reasm = Reassembler(10 * MB, 2 * MB)
        async for raw in call:
            frame = parse_frame(raw, 3 * MB)
            if frame.WhichOneof("kind") == "welcome":
                count[0] += 1
                if count[0] == n:
                    welcomed.set()
            elif frame.WhichOneof("kind") == "chunk":
                data = reasm.feed(frame.chunk)
                if data is None:
                    continue
                env = decode_envelope(data)
                assert list(env.receivers) == [cid]
                broadcast_seen.append(from_value(env.content)["payload"])
                note = pb.Envelope(msg_type="note", sender=cid, receivers=[0], round=env.round)
                for f in chunk_frames(envelope_parts(note, encode_value({"n": cid})), 1, 2 * MB, FIRST_CHUNK):
                    out.put_nowait(f)
                out.put_nowait(pb.Frame(bye=pb.Bye(reason="done")).SerializeToString())
                out.put_nowait(None)

    tasks = [asyncio.create_task(client(cid)) for cid in range(1, n + 1)]
    await asyncio.wait_for(welcomed.wait(), 60)
    connected.set()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    await channel.close()


def test_hundreds_of_streams_share_one_thread_and_one_encoded_broadcast():
    n = 300
    cfg = small_cfg(None, federate__mode="distributed", federate__client_num=n, distribute__role="server",
                    distribute__server_port=0, distribute__insecure=True, distribute__token="fleet")
    comm = GrpcServerComm(cfg, _Now(), lambda *a: None, lambda *a: None)
    inbox = _Inbox()
    comm.attach(inbox)
    before = _threads()
    port = comm.start()
    connected, seen = threading.Event(), []
    fleet = threading.Thread(target=lambda: asyncio.run(_fleet(port, n, connected, seen)), daemon=True)
    try:
        fleet.start()
        assert connected.wait(60), "the fleet did not connect"
        assert comm.live_ids() == list(range(1, n + 1))
        # The sync server held two threads per stream; this one holds a handful in all
        # (its event loop, gRPC's pollers, the decoder pool, and the fleet's own loop).
        assert _threads() - before < 40
        payload = b"\x07" * 50_000
        comm.send(Message("note", 0, tuple(range(1, n + 1)), 3, 0.0, {"payload": payload}))
        with inbox.cond:
            assert inbox.cond.wait_for(lambda: len(inbox.got) == n, 60), len(inbox.got)
        assert sorted(inbox.got) == [(c, c) for c in range(1, n + 1)]
        fleet.join(60)
        assert len(seen) == n and all(p == payload for p in seen)
    finally:
        comm.stop(0.5)


def test_events_handed_over_together_run_in_order_until_one_stops_the_scheduler():
    from fedcore.comm.handover import Batch as _Batch
    from fedcore.kernel.scheduler import Scheduler
    scheduler, ran = Scheduler(), []
    events = [lambda: ran.append(1), lambda: (ran.append(2), scheduler.stop()), lambda: ran.append(3)]
    _Batch(events, scheduler)()
    assert ran == [1, 2]     # as the third would have stayed in the stopped scheduler's queue


def test_a_peer_connecting_again_and_again_does_not_flood_the_log(caplog):
    cfg = small_cfg(None, federate__mode="distributed", federate__client_num=2, distribute__role="server",
                    distribute__server_port=0, distribute__insecure=True, distribute__token="t")
    comm = GrpcServerComm(cfg, _Now(), lambda *a: None, lambda *a: None)
    comm.attach(_Inbox())
    port = comm.start()
    bye = pb.Frame(bye=pb.Bye(reason="again")).SerializeToString()
    try:
        with caplog.at_level("INFO", logger="fedcore.deploy"), grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for k in range(40):   # a fresh session each time: "connected", not "reconnected"
                md = ((MD_CLIENT_ID, "1"), (MD_SESSION, f"s{k}"), (MD_TOKEN, "Bearer t"))
                for _ in ch.stream_stream(METHOD)(iter([bye]), metadata=md):
                    pass
    finally:
        comm.stop(0.5)
    lines = [r.getMessage() for r in caplog.records if "client 1 connected" in r.getMessage()]
    assert len(lines) == 1 and comm.describe()["1"]["state"] == "left"
