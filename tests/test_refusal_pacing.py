"""Refusal pacing: the server takes refused calls from gRPC at a bounded rate (comm/refusal_pacing.py)."""
import asyncio
import threading
import time

import grpc
import pytest

from fedcore.comm.grpc_server import GrpcServerComm
from fedcore.comm.refusal_pacing import RefusalPacer
from fedcore.comm.stream import MD_CLIENT_ID, MD_SESSION, MD_TOKEN, METHOD, bye_frame
from tests.conftest import small_cfg
from tests.test_deploy_auth import _Now, _Server, _join


class _Clock:
    """A loop as far as the bucket looks at one: its time, set by the test."""

    def __init__(self):
        self.now = 100.0

    def time(self):
        return self.now


def test_the_bucket_holds_a_tenth_of_a_seconds_worth_and_an_admitted_call_gives_its_token_back():
    clock = _Clock()
    pacer = RefusalPacer(clock, rate=20.0)
    assert pacer.burst == 2                       # 20/s x 0.1 s
    assert pacer._take() and pacer._take()        # two asks at once
    assert not pacer._take()
    assert pacer.wait() == pytest.approx(0.05)    # empty: a token in 1/20 s
    clock.now += 0.02
    assert pacer.wait() == pytest.approx(0.03)    # 0.4 of a token back
    assert not pacer._take()
    pacer.admitted()                              # the call taken was admitted: 1.4 tokens
    assert pacer._take() and not pacer._take()
    assert pacer.wait() == pytest.approx(0.6 / 20)
    clock.now += 10.0
    assert pacer.wait() == 0.0
    pacer.admitted()                              # refilled to the burst, no further
    assert pacer._take() and pacer._take() and not pacer._take()
    assert RefusalPacer(clock, rate=1000.0).burst == 100
    assert RefusalPacer(clock, rate=3.0).burst == 1


def test_only_the_task_asking_grpc_for_a_call_waits_for_a_token_and_a_cancelled_one_asks_nothing():
    async def _request_call():   # named as gRPC's asyncio server names its ask for the next call
        asked.append(time.monotonic())
        return "call"

    async def other():
        return "other"

    async def main():
        loop = asyncio.get_running_loop()
        pacer = RefusalPacer(loop, rate=10.0)   # a burst of 1
        pacer.install()
        assert await loop.create_task(_request_call()) == "call"   # the token: asked at once
        assert pacer.engaged and pacer.delayed == 0
        started = time.monotonic()              # empty now: the next ask waits 0.1 s
        assert await loop.create_task(other()) == "other"
        assert time.monotonic() - started < 0.09 and len(asked) == 1   # other tasks never wait
        assert await loop.create_task(_request_call()) == "call"
        assert asked[1] - started >= 0.09 and pacer.delayed == 1
        inner = _request_call()
        waiting = loop.create_task(inner)
        await asyncio.sleep(0.01)
        waiting.cancel()                        # the server stopping while an ask waits
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert inner.cr_frame is None and len(asked) == 2   # closed, never run: nothing asked
    asked = []
    asyncio.run(main())


def test_grpcs_asyncio_server_asks_for_its_calls_through_the_pacer():
    # the pacing rests on how gRPC's asyncio server asks for calls: a gRPC that asks otherwise
    # leaves `engaged` False (and the fedcore server logs it), which this test would show
    async def main():
        pacer = RefusalPacer(asyncio.get_running_loop(), rate=10.0)
        pacer.install()
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return pacer.engaged
        finally:
            await server.stop(None)
    assert asyncio.run(main()) is True


@pytest.fixture
def pacing_server():
    cfg = small_cfg(None, federate__mode="distributed", federate__client_num=3, distribute__role="server",
                    distribute__server_port=0, distribute__insecure=True, distribute__token="right",
                    distribute__refusals_per_second=20.0)
    comm = GrpcServerComm(cfg, _Now(), lambda *a: None, lambda *a: None)
    comm.attach(_Server())
    port = comm.start()
    yield comm, port
    comm.stop(0.2)


def test_a_burst_of_refused_calls_is_answered_at_the_configured_rate_every_one_of_them(pacing_server):
    # 30 callers with a wrong token, each on its own connection (a connection's later refusals
    # are held: comm/connections.py), connected first, then calling all at once. The server
    # asks for calls at 20 a second after a burst of 2: the first call takes the ask already
    # waiting, the next two the burst, each of the other 27 waits for a token, so the last is
    # answered at least 27/20 s after the first was taken. Every caller is told why.
    comm, port = pacing_server
    answers, lock, ready = [], threading.Lock(), threading.Barrier(30)

    def call(k: int) -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        rpc = channel.stream_stream(METHOD)
        md = [(MD_CLIENT_ID, "1"), (MD_SESSION, f"s{k}"), (MD_TOKEN, "Bearer wrong")]
        grpc.channel_ready_future(channel).result(timeout=20)   # connected: the calls go out together
        ready.wait(30)
        try:
            for _ in rpc(iter([bye_frame("test")]), metadata=md, timeout=30):
                pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        answered = time.monotonic()
        channel.close()
        with lock:
            answers.append((answered, code))

    threads = [threading.Thread(target=call, args=(k,)) for k in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [code for _, code in answers] == [grpc.StatusCode.UNAUTHENTICATED] * 30
    times = sorted(t for t, _ in answers)
    assert times[-1] - times[0] >= 27 / 20.0 - 0.05   # less the first answer's way back
    assert comm._pacer.delayed >= 27
    assert comm.refusals()["next calls taken late while refusals came fast"] == comm._pacer.delayed
    # after them, a client with the right token joins
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert _join(channel.stream_stream(METHOD), "right", client="2")[0] == grpc.StatusCode.OK
    finally:
        channel.close()
