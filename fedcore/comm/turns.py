"""Large messages take turns: the server buffers one at a time, whatever the number of senders.

A server folding each update into a running sum as it arrives (algorithms/streaming.py)
holds the global model and the sum; without turns, every client sending at once would
still have its update reassembled and decoded in parallel, one model-sized buffer per
stream. A stream about to start a message of at least `TURN_BYTES` waits for the turn
before reading on, so gRPC's flow control holds the sender back (what it sent ahead
stays within `distribute.stream_window`, fixed by the server). The turn is the message's
own, not its stream's: it is given back once the message has been delivered to the
server's handlers, or was refused, or its stream ended before it was whole (ended while it
decodes, once the decoding is done: the message is in memory until then). While it waits
the stream counts as alive: its client is not silent, the server is busy with another's model.

A turn is not held at the others' expense: while another stream waits, the message being
received must arrive at `rate` bytes/s after its first `TURN_GRACE` seconds (`overdue`), or
its stream is ended and its client sends it again, behind the streams that waited. Without
this one token holder announcing a large message and sending a byte now and then (within
`distribute.min_bytes_per_second`'s allowance: hours for a large model) held every other
client's update back, and the round with it.
"""
from __future__ import annotations

import asyncio
from time import monotonic
from typing import Callable

__all__ = ["TURN_BYTES", "TURN_GRACE", "Turns"]

TURN_BYTES = 16 * 2 ** 20   # messages this large take turns (a model worth streaming)
TURN_GRACE = 5.0            # seconds a turn is held before its message's rate is judged


class Turns:
    """One turn, lent on the event loop to one owner (a large message) at a time; while
    others wait, taken back from an owner whose message arrives slower than `rate` bytes/s
    (None: never)."""

    def __init__(self, rate: float | None = None) -> None:
        self._lock = asyncio.Lock()
        self._owner: object | None = None
        self._progress: Callable[[], tuple[float, int] | None] | None = None
        self._lose: Callable[[str], None] | None = None
        self.waiting = 0       # streams waiting for the turn
        self.rate = rate or None

    async def take(self, owner: object, keep_alive: Callable[[], None],
                   progress: Callable[[], tuple[float, int] | None] | None = None,
                   lose: Callable[[str], None] | None = None, interval: float = 1.0) -> None:
        """Wait for the turn (keeping the waiting stream alive every `interval` seconds, and
        judging the holder's pace meanwhile). `progress()` gives the owner's message in
        progress as (when it started, bytes received), None between messages; `lose(why)`
        ends the owner's stream and gives the turn back, if it is too slow."""
        self.waiting += 1
        try:
            while True:
                keep_alive()
                try:
                    await asyncio.wait_for(self._lock.acquire(), interval)
                    break
                except asyncio.TimeoutError:
                    self._judge()
        finally:
            self.waiting -= 1
        self._owner, self._progress, self._lose = owner, progress, lose

    def overdue(self) -> str | None:
        """Why the holder must give up the turn (None if it may keep it): another stream waits,
        and of the message it is receiving fewer than `rate` bytes a second have come since the
        message's first TURN_GRACE seconds. A holder between messages (its last one being
        handled) is not judged."""
        if self.rate is None or not self.waiting or self._progress is None:
            return None
        progress = self._progress()
        if progress is None:
            return None
        started, received = progress
        took = monotonic() - started
        if received >= self.rate * (took - TURN_GRACE):
            return None
        return (f"gave up its turn for large messages: {received} bytes in {took:.0f}s while "
                f"{self.waiting} other upload(s) waited (distribute.turn_bytes_per_second="
                f"{self.rate:g}); it is to be sent again")

    def _judge(self) -> None:
        """By a waiting stream: end the holder's stream if it is overdue. Judged here, not by
        the holder's own stream, whose writer may be stuck on a peer that stopped reading."""
        why = self.overdue()
        if why is not None and self._lose is not None:
            lose, self._lose = self._lose, None
            lose(why)

    def give_back(self, owner: object) -> None:
        """On the loop: release the turn if `owner` holds it (idempotent)."""
        if owner is not None and self._owner is owner and self._lock.locked():
            self._owner = self._progress = self._lose = None
            self._lock.release()
