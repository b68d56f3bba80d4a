"""A streaming call's responses, read on a thread of their own, one at a time on demand.

gRPC's response iterator waits until the call's pending receive completes, and a
cancelled call whose receive the gRPC core never completes (a call left pending
by a server going down, with no connection under it) keeps that wait going for
ever, cancellation notwithstanding. Reading on a separate thread lets the caller
stop waiting after a bound and leave such a call behind. The next response is
read only when asked for, so gRPC's flow control still holds a server whose
frames the caller is not ready to take.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

__all__ = ["CallReader"]

_END = object()


class CallReader:
    """Responses of one call: `ask()` for the next, then `take(timeout)` it."""

    def __init__(self, call: Iterator[bytes], name: str = "fedcore-call-reader"):
        self._want = threading.Semaphore(0)
        self._got: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(call,), name=name, daemon=True).start()

    def _read(self, call: Iterator[bytes]) -> None:
        it = iter(call)
        while True:
            self._want.acquire()
            try:
                self._got.put(next(it))
            except StopIteration:
                self._got.put(_END)
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                self._got.put(exc)
                return

    def ask(self) -> None:
        """Read the next response (once the previous one was taken)."""
        self._want.release()

    def take(self, timeout: float) -> bytes | None:
        """The response asked for: None at the call's end; raises what ended the call badly,
        or queue.Empty after `timeout` seconds without it."""
        got = self._got.get(timeout=timeout)
        if got is _END:
            return None
        if isinstance(got, BaseException):
            raise got
        return got
