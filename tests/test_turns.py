"""Large messages take turns (fedcore/comm/turns.py): the turn goes back once the message is
handled, whatever happens to it, or every other client's large update would wait forever."""
import asyncio
import types

import pytest

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
            update_gate=lambda m: gates.get("update", True),
            metrics_gate=types.SimpleNamespace(admit=lambda m: gates.get("metrics", True)),
            server=types.SimpleNamespace(deliver=seen.append), quiet_info=lambda *a: None)
        stream = object()                               # the stream's reassembler owns the turn
        await turns.take(stream, lambda: None)
        Arrival(comm, Message(msg_type, 3, (SERVER_ID,), 1, 0.0, {}), 17 << 20, stream)()
        other = object()                                # another client's large message
        await asyncio.wait_for(turns.take(other, lambda: None), 2.0)
        return seen
    seen = asyncio.run(run())
    assert bool(seen) == delivered
