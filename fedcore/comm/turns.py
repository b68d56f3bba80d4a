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
"""
from __future__ import annotations

import asyncio
from typing import Callable

__all__ = ["TURN_BYTES", "Turns"]

TURN_BYTES = 16 * 2 ** 20   # messages this large take turns (a model worth streaming)


class Turns:
    """One turn, lent on the event loop to one owner (a stream's reassembler) at a time."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._owner: object | None = None

    async def take(self, owner: object, keep_alive: Callable[[], None], interval: float = 1.0) -> None:
        while True:
            keep_alive()
            try:
                await asyncio.wait_for(self._lock.acquire(), interval)
                break
            except asyncio.TimeoutError:
                continue
        self._owner = owner

    def give_back(self, owner: object) -> None:
        """On the loop: release the turn if `owner` holds it (idempotent)."""
        if owner is not None and self._owner is owner and self._lock.locked():
            self._owner = None
            self._lock.release()
