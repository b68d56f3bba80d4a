"""Large messages take turns: the server buffers one at a time, whatever the number of senders.

A server folding each update into a running sum as it arrives (algorithms/streaming.py)
holds the global model and the sum; without turns, every client sending at once would
still have its update reassembled and decoded in parallel, one model-sized buffer per
stream. A stream about to start a message of at least `TURN_BYTES` waits for the turn
before reading on, so gRPC's flow control holds the sender back (what it sent ahead
stays within `distribute.stream_window`, fixed by the server), and gives the turn back
once its message has been delivered to the server's handlers (or was refused, or the
stream ended). While it waits the stream counts as alive: its client is not silent, the
server is busy with another's model.

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
    """One turn, lent on the event loop to one owner (a stream's reassembler) at a time; while
    others wait, taken back from an owner whose message arrives slower than `rate` bytes/s
    (None: never)."""

    def __init__(self, rate: float | None = None) -> None:
        self._lock = asyncio.Lock()
        self._owner: object | None = None
        self._since = 0.0      # when the owner took the turn
        self.waiting = 0       # streams waiting for the turn
        self.rate = rate or None

    async def take(self, owner: object, keep_alive: Callable[[], None], interval: float = 1.0) -> None:
        self.waiting += 1
        try:
            while True:
                keep_alive()
                try:
                    await asyncio.wait_for(self._lock.acquire(), interval)
                    break
                except asyncio.TimeoutError:
                    continue
        finally:
            self.waiting -= 1
        self._owner, self._since = owner, monotonic()

    def overdue(self, owner: object, received: int) -> str | None:
        """Why `owner`, holding the turn, must give it up (None if it may keep it): another
        stream waits, and of its message, fewer than `rate` bytes a second have arrived since
        its first TURN_GRACE seconds with the turn (`received`: its bytes so far)."""
        if self.rate is None or self._owner is not owner or not self.waiting:
            return None
        held = monotonic() - self._since
        if received >= self.rate * (held - TURN_GRACE):
            return None
        return (f"gave up its turn for large messages: {received} bytes in {held:.0f}s while "
                f"{self.waiting} other upload(s) waited (distribute.turn_bytes_per_second="
                f"{self.rate:g}); it is to be sent again")

    def give_back(self, owner: object) -> None:
        """On the loop: release the turn if `owner` holds it (idempotent)."""
        if owner is not None and self._owner is owner and self._lock.locked():
            self._owner = None
            self._lock.release()
