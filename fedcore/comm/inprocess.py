"""Simulation: messages become events on the shared scheduler, timed by the time model.

Content is passed by reference (no copies, no serialization); the bytes a
message would take on the wire are computed exactly and counted. A link keeps its
order, as a deployed stream does: a message never arrives before one sent earlier
from the same sender to the same receiver (a smaller one would otherwise overtake
it: a round's `models` arriving before the previous round's `eval_request`, so a
personalized client was evaluated after training the next round).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from fedcore.kernel.message import SERVER_ID, Message
from fedcore.kernel.scheduler import PRIORITY_MESSAGE, Scheduler
from fedcore.runtime.timing import TimeModel

__all__ = ["InProcessComm"]


class InProcessComm:
    """Delivers each message to each receiver at `timestamp + transfer time`."""

    def __init__(self, scheduler: Scheduler, timing: TimeModel,
                 count_bytes: Callable[[Message, int, int], None]):
        self.scheduler = scheduler
        self.timing = timing
        self.count_bytes = count_bytes
        self.workers: dict = {}
        self.filters: list[Callable[[Message, int], bool]] = []
        # told of each message once it is on its way to a receiver that will get it (a
        # simulation's server folds an update as it is sent: algorithms/streaming.py)
        self.taps: list[Callable[[Message, int], None]] = []
        self._last_arrival: dict[tuple[int, int], float] = {}   # (sender, receiver) -> latest arrival
        self._prune_at = _PRUNE_AT
        # a star's links: the latest arrival by client id, [towards the server, from it]
        self._star = [np.full(0, -1.0), np.full(0, -1.0)]

    def attach(self, worker) -> None:
        self.workers[worker.id] = worker

    def send(self, msg: Message) -> None:
        # names looked up once per message, not once per receiver of a broadcast
        workers, filters, count, taps = self.workers, self.filters, self.count_bytes, self.taps
        transfer, schedule = self.timing.transfer_time, self.scheduler.schedule
        sender, sent = msg.sender, msg.timestamp
        for receiver in msg.receivers:
            worker = workers.get(receiver)
            if worker is None:
                raise KeyError(f"message '{msg.msg_type}' from {sender} to unknown worker {receiver}")
            if filters and not _kept(filters, msg, receiver):
                continue  # e.g. a dropped-out client's reply never arrives
            nbytes = msg.nbytes_to(receiver)
            count(msg, receiver, nbytes)
            arrival = self._in_order(sender, receiver, sent + transfer(sender, receiver, nbytes, SERVER_ID))
            schedule(arrival, PRIORITY_MESSAGE, _Delivery(worker, msg))
            for tap in taps:
                tap(msg, receiver)

    def _in_order(self, sender: int, receiver: int, arrival: float) -> float:
        """`arrival`, or the link's previous message's if later: behind it (the scheduler keeps
        ties in the order they were scheduled). A star's links, each a client's with the server,
        are two arrays indexed by the client (a million clients: 16 MB); any other link a dict."""
        if receiver == SERVER_ID and sender > 0:
            side, i = 0, sender
        elif sender == SERVER_ID and receiver > 0:
            side, i = 1, receiver
        else:
            last = self._last_arrival
            earlier = last.get((sender, receiver))
            if earlier is not None and earlier > arrival:
                arrival = earlier
            last[(sender, receiver)] = arrival
            if len(last) > self._prune_at:
                self._forget_past_links()
            return arrival
        times = self._star[side]
        if i >= len(times):
            grown = np.full(max(2 * len(times), i + 1, 1024), -1.0)
            grown[:len(times)] = times
            self._star[side] = times = grown
        earlier = times[i]
        if earlier > arrival:
            arrival = float(earlier)
        times[i] = arrival
        return arrival

    def _forget_past_links(self) -> None:
        """Links whose last message has arrived constrain nothing: drop them (a course of a
        million clients touches a million links)."""
        now = self.scheduler.now
        self._last_arrival = {k: t for k, t in self._last_arrival.items() if t > now}
        self._prune_at = max(_PRUNE_AT, 2 * len(self._last_arrival))   # amortized, however many are ahead


_PRUNE_AT = 4096   # links remembered before those in the past are dropped


def _kept(filters: list, msg: Message, receiver: int) -> bool:
    """Whether every filter lets `msg` reach `receiver` (all of them are asked, in order, until
    one drops it: a filter may note the message as it passes)."""
    for keep in filters:
        if not keep(msg, receiver):
            return False
    return True


class _Delivery:
    """A scheduled arrival; a class rather than a closure keeps it cheap and inspectable."""

    __slots__ = ("worker", "msg")

    def __init__(self, worker, msg: Message):
        self.worker = worker
        self.msg = msg

    def __call__(self) -> None:
        self.worker.deliver(self.msg)
