"""The server holds back, briefly, its asks to gRPC for calls after taking one that belonged to
a connection already closed for its refusals.

gRPC's asyncio server asks gRPC for the next call as soon as it has handed the last one to a
handler, and every call it takes costs its event loop far more (tasks, a context, the
handler, the status sent back: some 0.1 ms) than gRPC spends on it in its transport. When
the guard (connections.py) closes a flooding connection, gRPC still parses what it had read
from it: under a rapid reset (calls opened and reset at once, on connections reopened as
fast as they are closed) each new call it finds there is handed straight to the ask waiting
for it, before its reset is read. With the default stream limit that was 24 of the 26 calls
the handler saw per connection (3,400 a second in all, a third of a core; 2-core machine,
`python -m bench.flood_rate --streams 0`).

After such a call `AskPacer` holds the server's asks back for PAUSE (1 ms), during which
gRPC reads the resets of that connection's other calls and drops them itself, unseen. (The
ask made right after taking the call is already on its way when the call's handler finds
its connection closed: the pause holds back the asks made after that.) Pauses take at most
PAUSE_SHARE of the time (a budget of seconds refilled at that rate, holding PAUSE_BURST), and
an ask waits out at most the one pause under way when it is made: an attacker who mixes
such calls into a flood that keeps live calls waiting (an honest client's among them) slows
the server's taking of calls by at most a quarter. What waits meanwhile in gRPC's backlog of
calls not yet taken counts towards that backlog's limit, past which gRPC drops new calls
(`grpc.server.max_pending_requests`, set in grpc_server.py).

gRPC offers no hook for this. Its server asks for each call in a task of its own, made with
the event loop's task factory; the pacer installs a factory that delays the start of the task
that asks (its coroutine is named `_request_call`, REQUEST_CALL, in grpcio 1.85). Where a
gRPC version asks differently, `engaged` stays False and the server says so in its log.
"""
from __future__ import annotations

import asyncio

__all__ = ["PAUSE", "PAUSE_SHARE", "PAUSE_BURST", "REQUEST_CALL", "AskPacer"]

PAUSE = 0.001          # seconds the asks are held back after a call of a closed connection
PAUSE_SHARE = 0.25     # the most of the time spent paused
PAUSE_BURST = 25 * PAUSE   # paused seconds that may be spent at once
REQUEST_CALL = ("_request_call", "_request_registered_call")   # gRPC's coroutines that ask for a call


class AskPacer:
    """Pauses the asks of a gRPC asyncio server on `loop` after wasted calls."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._budget, self._at = PAUSE_BURST, loop.time()
        self._resume = 0.0     # loop time before which no ask starts
        self._previous = None  # the loop's task factory before this one
        self.engaged = False   # whether gRPC's asking for a call went through the factory
        self.paused = 0        # pauses started
        self.delayed = 0       # asks held back by one

    def install(self) -> None:
        """Make the loop's tasks through this pacer (before the gRPC server starts)."""
        self._previous = self.loop.get_task_factory()
        self.loop.set_task_factory(self._task)

    def wasted(self) -> None:
        """The call taken belonged to a connection closed for its refusals: asks made from now
        wait PAUSE, unless a pause is under way or the budget is spent."""
        now = self.loop.time()
        self._budget = min(PAUSE_BURST, self._budget + (now - self._at) * PAUSE_SHARE)
        self._at = now
        if now >= self._resume and self._budget >= PAUSE:
            self._budget -= PAUSE
            self._resume = now + PAUSE
            self.paused += 1

    def wait(self) -> float:
        """Seconds before the next ask may start."""
        return max(0.0, self._resume - self.loop.time())

    def _task(self, loop, coro, **kwargs):
        ask = None
        if getattr(coro, "__name__", None) in REQUEST_CALL:
            self.engaged = True
            if self.wait() > 0:   # the pause under way, not any started while this ask waits
                ask, coro = coro, self._later(coro, self._resume)
                self.delayed += 1
        if self._previous is not None:
            task = self._previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        if ask is not None:   # cancelled before the pause ended (the server stopping): never started
            task.add_done_callback(lambda _: ask.close())
        return task

    async def _later(self, ask, resume: float):
        """`ask` (gRPC's request for its next call), started at loop time `resume`."""
        while (seconds := resume - self.loop.time()) > 0:
            await asyncio.sleep(seconds)
        return await ask
