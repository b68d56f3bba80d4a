"""The server's per-session outbox: filled from any thread, drained on the server's event loop.

The course sends from its scheduler thread; each client's stream is a
coroutine on the server's one event loop. A stream with nothing to send waits
on an `asyncio.Event` that only the loop touches, so a connected client costs
no thread. Otherwise the rules are `Outbox`'s: one stream at a time owns the
outbox (a reconnect takes it over), and a message leaves the queue only once
gRPC has taken its last frame, so one cut short is sent again whole on the
session's next stream.
"""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable, Iterable, Iterator

from fedcore.comm.chunking import chunk_frames
from fedcore.comm.stream import OwnedQueue

__all__ = ["AsyncOutbox", "wake_all"]


class AsyncOutbox(OwnedQueue):
    """Queued encoded messages of one session, drained by a coroutine on `loop`."""

    def __init__(self, chunk_size: int, first_size: int, ids: Iterator[int], loop: asyncio.AbstractEventLoop):
        """`first_size` bounds a message's first chunk (`chunking.first_chunk_size`); `ids`
        numbers the messages: the server shares one counter among a client's successive
        sessions, whose receiver must see increasing ids across them."""
        self._lock = threading.Lock()
        super().__init__(self._lock)
        self.chunk_size, self.first_size = chunk_size, first_size
        self._ids = ids
        self._loop = loop
        self._ready = asyncio.Event()

    def put_message(self, parts: tuple[bytes, ...], sha: bytes | None = None, notify: bool = True) -> int:
        """Queue one encoded envelope (as parts; `sha` its SHA-256 when already known). With
        `notify=False` the caller wakes the draining stream itself (see `wake_all`)."""
        with self._lock:
            mid = next(self._ids)
            self._items.append((mid, parts, sha))
        if notify:
            self.wake()
        return mid

    def _head(self):
        with self._lock:
            return self._items[0] if self._items else None

    def wake(self) -> None:
        """Wake the draining stream, from any thread."""
        wake_all((self,))

    async def frames(self, token: object, alive: Callable[[], bool], interval: float,
                     on_idle: Callable[[], bytes | None]) -> AsyncIterator[bytes]:
        """Frames to write while this stream owns the outbox and `alive()` holds; `on_idle`'s
        frame (a heartbeat; None ends the stream) after `interval` seconds with nothing to send."""
        def mine() -> bool:
            return self._owner is token and alive()

        while True:
            item = self._head()
            if item is None and mine():
                self._ready.clear()
                item = self._head()   # a message queued between the look and the clear is not missed
                if item is None:
                    await _wait(self._ready, interval)
                    item = self._head()
            if not mine():
                return
            if item is None:
                idle = on_idle()
                if idle is None:
                    return
                yield idle
                continue
            mid, parts, sha = item
            for frame in chunk_frames(parts, mid, self.chunk_size, self.first_size, sha=sha):
                if not mine():
                    return
                yield frame
                frame = None   # a sent frame is not kept while the stream waits for more
            with self._lock:
                if self._items and self._items[0] is item:
                    self._items.popleft()
            # nor is the sent message: a broadcast model would stay alive here, in every idle
            # stream, until its next message (a model's worth of server memory all round long)
            item = parts = sha = None


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Wait until `event` is set or `seconds` have passed."""
    try:
        if _TIMEOUT is not None:   # Python 3.11+: a timer, no extra task
            async with _TIMEOUT(seconds):
                await event.wait()
        else:
            await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        pass


_TIMEOUT = getattr(asyncio, "timeout", None)


def wake_all(outboxes: Iterable[AsyncOutbox]) -> None:
    """Wake the streams draining `outboxes` (all on one loop), with one hand-over to the loop
    for all of them when called from another thread (a broadcast wakes thousands)."""
    boxes = list(outboxes)
    if not boxes:
        return
    loop = boxes[0]._loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        _set(boxes)
    elif not loop.is_closed():
        try:
            loop.call_soon_threadsafe(_set, boxes)
        except RuntimeError:   # the loop closed meanwhile: nobody is left to wake
            pass


def _set(boxes: list[AsyncOutbox]) -> None:
    for box in boxes:
        box._ready.set()
