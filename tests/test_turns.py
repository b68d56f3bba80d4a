"""Large messages take turns (fedcore/comm/turns.py): the turn goes back once the message is
handled, whatever happens to it, or every other client's large update would wait forever."""
import asyncio
import types

import pytest

from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.comm.handover import Arrival
from fedcore.comm.turns import Turns
from fedcore.kernel.message import SERVER_ID, Message


@pytest.mark.parametrize("msg_type, gates, delivered", [
    ("updates", {"update": True}, True),     # handled
    ("updates", {"update": False}, False),   # dropped: a round already aggregated, or no join yet
    ("metrics", {"metrics": False}, False),  # dropped by the metrics gate
])
def test_a_large_message_gives_the_turn_back_whether_handled_or_dropped(msg_type, gates, delivered):
    async def run():
        loop = asyncio.get_running_loop()
        turns, seen = Turns(), []
        comm = types.SimpleNamespace(
            _turns=turns, _loop=loop, count_bytes=lambda *a: None, after_delivery=lambda: None,
            _on_loop=lambda fn, *a: loop.call_soon_threadsafe(fn, *a),
            update_gate=lambda m: gates.get("update", True),
            metrics_gate=types.SimpleNamespace(admit=lambda m: gates.get("metrics", True)),
            server=types.SimpleNamespace(deliver=seen.append), quiet_info=lambda *a: None)
        stream = object()                               # the large message's own turn
        await turns.take(stream, lambda: None)
        Arrival(comm, Message(msg_type, 3, (SERVER_ID,), 1, 0.0, {}), 17 << 20, stream)()
        other = object()                                # another client's large message
        await asyncio.wait_for(turns.take(other, lambda: None), 2.0)
        return seen
    seen = asyncio.run(run())
    assert bool(seen) == delivered


def test_the_turn_is_taken_back_only_from_a_slow_message_while_another_waits(monkeypatch):
    """A message holding the turn must have come at `rate` bytes/s since its first TURN_GRACE
    seconds, but only while another stream waits (alone, a slow link keeps its turn) and only
    while it is being received (not while the last one is handled). The waiting stream judges
    it: the holder's own writer may be stuck on a peer that stopped reading."""
    from fedcore.comm import turns as turns_module
    now = [100.0]
    monkeypatch.setattr(turns_module, "monotonic", lambda: now[0])
    grace, rate = turns_module.TURN_GRACE, 1000.0
    message = {"progress": (now[0], 0)}   # the holder's message: (started, bytes received)
    lost = []

    async def run():
        turns, holder, waiter = Turns(rate), object(), object()

        def lose(why):   # what the server does: end the holder's stream, give the turn back
            lost.append(why)
            turns.give_back(holder)
        await turns.take(holder, lambda: None, lambda: message["progress"], lose)
        now[0] += grace + 10                                   # 10 s past the grace
        verdicts = {"alone": turns.overdue()}                  # nobody waits: kept, however slow
        message["progress"] = (100.0, 10_000)                   # rate x 10 s: on time
        waiting = asyncio.ensure_future(turns.take(waiter, lambda: None, interval=0.01))
        await asyncio.sleep(0.05)
        verdicts["on time"] = turns.overdue()
        message["progress"] = None                             # between messages: not judged
        verdicts["between"] = turns.overdue()
        message["progress"] = (now[0] - 3, 0)                  # a new message, 3 s old: in grace
        verdicts["new"] = turns.overdue()
        await asyncio.sleep(0.05)
        assert not lost and not waiting.done()
        message["progress"] = (100.0, 9_999)                   # one byte short
        await asyncio.wait_for(waiting, 2.0)                   # judged by the waiter, which gets the turn
        return verdicts, turns.waiting
    verdicts, waiting = asyncio.run(run())
    assert all(v is None for v in verdicts.values()), verdicts
    assert lost == [lost[0]] and lost[0].startswith(
        "gave up its turn for large messages: 9999 bytes in 15s while 1 other")
    assert waiting == 0
    assert Turns(None).rate is None and Turns(0).rate is None   # 0: a turn is never taken back


def test_a_small_messages_delivery_leaves_the_turn_its_streams_next_large_message_took():
    # A stream's small message (a join) is handed to the scheduler; before the scheduler
    # delivers it, the same stream starts a large message and takes the turn. Delivering the
    # small message must not give that turn back: it did (the turn's owner is the stream's
    # reassembler), so a trickler's large message was out of every judgement, and two large
    # messages could be buffered at once.
    import hashlib
    from fedcore.comm.chunking import Reassembler
    from fedcore.comm.server_inbound import Inbound, StreamStatus
    from fedcore.comm.turns import TURN_BYTES
    from fedcore.wire import fedcore_pb2 as pb

    class Server(Inbound):
        _on_loop = GrpcServerComm._on_loop

        def __init__(self, loop):
            self._turns, self._loop, self.handed = Turns(), loop, []
            self.count_bytes = self.after_delivery = self.quiet_info = lambda *a: None
            self.server = types.SimpleNamespace(deliver=lambda m: None)

        def _decode(self, s, data):
            return Message("join_in", s.client_id, (SERVER_ID,), 0, 0.0, {})

        def _hand_over(self, event):
            self.handed.append(event)

    async def run():
        loop = asyncio.get_running_loop()
        server = Server(loop)
        status = StreamStatus(Reassembler(64 << 20, 1 << 20))
        s = types.SimpleNamespace(client_id=3, last_delivered=0, receiving=False, last_seen=0.0, joining=True)
        small = b"join"
        await server._take(s, pb.Frame(chunk=pb.Chunk(message_id=1, offset=0, total_size=len(small), data=small,
                                                      sha256=hashlib.sha256(small).digest())), status)
        await server._take(s, pb.Frame(chunk=pb.Chunk(message_id=2, offset=0, total_size=TURN_BYTES + 1,
                                                      data=bytes(1024), sha256=bytes(32))), status)
        assert len(server.handed) == 1
        server.handed[0]()                      # the join delivered on the scheduler thread
        await asyncio.sleep(0.05)               # where it would have given the turn back
        other = asyncio.ensure_future(server._turns.take(object(), lambda: None))
        await asyncio.sleep(0.2)
        held = not other.done()                 # another client's large message still waits
        other.cancel()
        return held
    assert asyncio.run(run())


def test_only_a_large_message_in_progress_is_judged_for_its_turn():
    # After its large message is received (and while it is being handled), a stream may be
    # receiving a small one slowly: that one holds no turn and must not lose the large one's.
    from fedcore.comm.chunking import Reassembler
    from fedcore.comm.turns import TURN_BYTES
    from fedcore.wire import fedcore_pb2 as pb
    small, large = Reassembler(64 << 20, 1 << 20), Reassembler(64 << 20, 1 << 20)
    small.feed(pb.Chunk(message_id=1, offset=0, total_size=3 << 20, data=bytes(1 << 20), sha256=bytes(32)))
    large.feed(pb.Chunk(message_id=1, offset=0, total_size=TURN_BYTES, data=bytes(1 << 20), sha256=bytes(32)))
    assert small.progress() is not None and small.progress(TURN_BYTES) is None
    assert large.progress(TURN_BYTES) == (large.started, 1 << 20)


def test_a_stream_ending_while_its_large_message_decodes_keeps_the_turn_until_the_decode_is_done():
    # The message is in memory until its decoding thread is done with it, so the next large
    # message may not come in meanwhile (it did: the stream's end gave the turn back at once).
    import hashlib
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from fedcore.comm.chunking import Reassembler
    from fedcore.comm.server_inbound import Inbound, StreamStatus
    from fedcore.comm.turns import TURN_BYTES
    from fedcore.wire import fedcore_pb2 as pb
    decoding, finish = threading.Event(), threading.Event()

    class Server(Inbound):
        _on_loop = GrpcServerComm._on_loop

        def __init__(self, loop):
            self._turns, self._loop, self._decoder = Turns(), loop, ThreadPoolExecutor(1)

        def _decode_large(self, s, data):
            decoding.set()
            finish.wait(10)
            return Message("updates", s.client_id, (SERVER_ID,), 1, 0.0, {})

    async def run():
        loop = asyncio.get_running_loop()
        server = Server(loop)
        status = StreamStatus(Reassembler(64 << 20, 32 << 20))
        s = types.SimpleNamespace(client_id=3, last_delivered=0, receiving=False, last_seen=0.0, joining=True)
        data = bytes(TURN_BYTES)
        reader = asyncio.ensure_future(server._take(s, pb.Frame(chunk=pb.Chunk(
            message_id=1, offset=0, total_size=len(data), data=data, sha256=hashlib.sha256(data).digest())), status))
        await loop.run_in_executor(None, decoding.wait, 10)
        reader.cancel()                          # the stream ended while the thread decodes
        await asyncio.gather(reader, return_exceptions=True)
        server._turns.give_back(status.turn)     # what the reader's end does (server_inbound._read)
        other = asyncio.ensure_future(server._turns.take(object(), lambda: None))
        await asyncio.sleep(0.2)
        held_while_decoding = not other.done()
        finish.set()                             # the decode is done: the turn comes back
        await asyncio.wait_for(other, 5)
        server._decoder.shutdown()
        return held_while_decoding
    assert asyncio.run(run())
