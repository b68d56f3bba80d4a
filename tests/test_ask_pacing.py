"""The server's pause after a call of a closed connection (comm/ask_pacing.py)."""
import asyncio
import threading

import grpc
import pytest

from fedcore.comm.ask_pacing import PAUSE, PAUSE_BURST, PAUSE_SHARE, AskPacer
from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.comm.stream import METHOD
from tests.conftest import small_cfg
from tests.h2_attack import StreamFlood
from tests.test_deploy_auth import _Now, _Server, _join


class _Clock:
    """A loop as far as the pacer's budget looks at one: its time, set by the test."""

    def __init__(self):
        self.now = 100.0

    def time(self):
        return self.now


def test_a_wasted_call_pauses_the_next_ask_once_and_pauses_take_at_most_their_share_of_the_time():
    clock = _Clock()
    pacer = AskPacer(clock)
    assert pacer.wait() == 0.0
    pacer.wasted()
    assert pacer.wait() == pytest.approx(PAUSE) and pacer.paused == 1
    clock.now += PAUSE / 2
    pacer.wasted()                                  # pausing already: not lengthened
    assert pacer.wait() == pytest.approx(PAUSE / 2) and pacer.paused == 1
    clock.now += PAUSE / 2
    assert pacer.wait() == 0.0
    # wasted calls every half pause for 10 s: paused at most PAUSE_SHARE of the time, plus
    # the budget held at the start; and no less than that share less one pause (the budget
    # is spent whenever it allows a pause)
    start, paused = clock.now, pacer.paused
    while clock.now < start + 10.0:
        pacer.wasted()
        clock.now += PAUSE / 2
    spent = (pacer.paused - paused) * PAUSE
    assert PAUSE_SHARE * 10.0 - PAUSE <= spent <= PAUSE_SHARE * 10.0 + PAUSE_BURST + 1e-9
    clock.now += 1000.0                             # refilled to PAUSE_BURST, no further
    paused = pacer.paused
    for _ in range(1000):
        pacer.wasted()
        clock.now += PAUSE
    assert (pacer.paused - paused) * PAUSE <= 1000 * PAUSE * PAUSE_SHARE + PAUSE_BURST + 1e-9


def test_asks_made_after_a_wasted_call_wait_out_the_pause_under_way_and_no_later_one():
    async def _request_call():   # named as gRPC's asyncio server names its ask for the next call
        asked.append(asyncio.get_running_loop().time())
        return "call"

    async def other():
        return "other"

    async def main():
        loop = asyncio.get_running_loop()
        pacer = AskPacer(loop)
        pacer.install()
        # as gRPC does it: the ask for the next call is made as soon as a call is taken, before
        # that call's handler finds its connection closed; that ask is not held back
        first = loop.create_task(_request_call())
        pacer.wasted()
        assert await first == "call" and pacer.engaged and pacer.delayed == 0
        resume = loop.time() + PAUSE
        assert pacer.wait() > 0
        held = loop.create_task(_request_call())   # made during the pause: waits it out
        assert pacer.delayed == 1
        assert await loop.create_task(other()) == "other" and len(asked) == 1   # other tasks never wait
        pacer._resume = loop.time() + 0.5          # a later pause, started while it waits ...
        assert await held == "call"
        assert resume - 1e-6 <= asked[1] < pacer._resume - 0.3   # ... does not hold it longer
        await asyncio.sleep(pacer.wait())
        pacer.wasted()
        inner = _request_call()
        waiting = loop.create_task(inner)
        waiting.cancel()                         # the server stopping while an ask waits
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert inner.cr_frame is None and len(asked) == 2   # closed, never run: nothing asked
    asked = []
    asyncio.run(main())


def test_grpcs_asyncio_server_asks_for_its_calls_through_the_pacer():
    # the pause rests on how gRPC's asyncio server asks for calls: a gRPC that asks otherwise
    # leaves `engaged` False (and the fedcore server logs it), which this test would show
    async def main():
        pacer = AskPacer(asyncio.get_running_loop())
        pacer.install()
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return pacer.engaged
        finally:
            await server.stop(None)
    assert asyncio.run(main()) is True


@pytest.mark.parametrize("pause", [True, False])
def test_a_rapid_reset_makes_the_server_pause_after_calls_of_the_connections_it_closed(pause):
    # two connections opening token-less calls and resetting each at once, for 2 s, against
    # an in-process server with the default stream limit: the guard closes each connection at
    # its second refused call, and gRPC still hands the server calls it parsed from it; after
    # each the server holds its asks for more calls back 1 ms (unless
    # distribute.pause_after_closed_calls is off).
    # A client with the right token joins afterwards.
    cfg = small_cfg(None, federate__mode="distributed", federate__client_num=3, distribute__role="server",
                    distribute__server_port=0, distribute__insecure=True, distribute__token="right",
                    distribute__pause_after_closed_calls=pause)
    comm = GrpcServerComm(cfg, _Now(), lambda *a: None, lambda *a: None)
    comm.attach(_Server())
    port = comm.start()
    try:
        flood = StreamFlood(port, conns=2, reset=True)
        attacker = threading.Thread(target=flood.run, args=(2.0,))
        attacker.start()
        attacker.join(30)
        assert flood.calls >= 1000 and flood.closed > 0
        refusals = comm.refusals()
        assert refusals["connections closed after a refused call"] > 0
        held = "asks for a call held back after a call of a closed connection"
        if pause:   # gRPC's own asks were held back
            assert comm._pacer.engaged and comm._pacer.paused > 0 and comm._pacer.delayed > 0
            assert refusals[held] == comm._pacer.delayed
        else:
            assert comm._pacer is None and held not in refusals
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            assert _join(channel.stream_stream(METHOD), "right", client="2")[0] == grpc.StatusCode.OK
        finally:
            channel.close()
    finally:
        comm.stop(0.2)
