"""Refused calls reach the server's handlers at a bounded rate, so that a flood of them cannot
take the server's event loop from the course.

gRPC's asyncio server takes calls from gRPC one at a time: it asks for the next call as soon
as it has handed the last one to a handler, and every call it takes costs the event loop far
more (a task, a context, the handler, the status sent back: some 0.1 ms) than gRPC spends on
it in its transport. Under a rapid reset (calls opened and reset at once on connections
reopened as fast as they are closed) a call is always waiting to be taken: 3,400 a second
reached the handler with the default stream limit (26 for each connection the guard closed,
most of them already queued in gRPC when it closed it), and the event loop spent a third of
a core on them (2-core machine, `python -m bench.flood_rate`).

`RefusalPacer` holds back the asking, never an answer. Asking for a call takes a token from a
bucket refilled at `rate` a second that holds a tenth of a second's worth (BURST_SECONDS: a
few refusals at once are answered at once); a call that is admitted gives its token back.
While the bucket is empty the server asks gRPC for its next call only once a token is back,
so refused calls are taken at most `rate` a second after the burst. Meanwhile gRPC queues
the new calls and drops, inside its transport, those their senders reset: the call taken
next is the oldest one still waiting, such as an honest client's behind a rapid reset.
While nothing is refused (a whole fleet joining at once) no call waits.

gRPC offers no hook for this. Its server asks for each call in a task of its own, made with
the event loop's task factory; the pacer installs a factory that delays the start of the task
that asks (its coroutine is named `_request_call`, REQUEST_CALL, in grpcio 1.85). Where a
gRPC version asks differently, `engaged` stays False and the server says so in its log.
"""
from __future__ import annotations

import asyncio
import math

__all__ = ["BURST_SECONDS", "REQUEST_CALL", "RefusalPacer"]

BURST_SECONDS = 0.1   # the bucket holds this many seconds' worth of tokens
REQUEST_CALL = ("_request_call", "_request_registered_call")   # gRPC's coroutines that ask for a call


class RefusalPacer:
    """A token bucket of the server's asks for calls on `loop`: `rate` a second, `burst`
    (BURST_SECONDS' worth, at least 1) at once, an admitted call giving its token back; rate 0:
    no pacing."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rate: float):
        self.loop, self.rate = loop, rate
        self.burst = max(1, math.ceil(rate * BURST_SECONDS))
        self._tokens, self._at = float(self.burst), loop.time()
        self._previous = None  # the loop's task factory before this one
        self.engaged = False   # whether gRPC's asking for a call went through the factory
        self.delayed = 0       # times the asking waited for a token

    def install(self) -> None:
        """Make the loop's tasks through this pacer (before the gRPC server starts)."""
        if self.rate > 0:
            self._previous = self.loop.get_task_factory()
            self.loop.set_task_factory(self._task)

    def admitted(self) -> None:
        """The call taken last was admitted: the token its asking took comes back."""
        if self.rate > 0:
            self._tokens = min(float(self.burst), self._fill() + 1.0)

    def wait(self) -> float:
        """Seconds until a token is back (0: there is one)."""
        tokens = self._fill()
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def _take(self) -> bool:
        if self._fill() < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _fill(self) -> float:
        now = self.loop.time()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens

    def _task(self, loop, coro, **kwargs):
        if getattr(coro, "__name__", None) in REQUEST_CALL:
            self.engaged = True
            if not self._take():
                coro = self._later(coro)
        if self._previous is not None:
            return self._previous(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def _later(self, ask):
        """`ask` (gRPC's request for its next call), started once a token is back."""
        self.delayed += 1
        try:
            while not self._take():
                await asyncio.sleep(self.wait())
        except BaseException:
            ask.close()   # never started: nothing was asked of gRPC
            raise
        return await ask
