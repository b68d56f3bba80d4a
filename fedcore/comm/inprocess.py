"""Simulation: messages become events on the shared scheduler, timed by the time model.

Content is passed by reference (no copies, no serialization); the bytes a
message would take on the wire are computed exactly and counted.
"""
from __future__ import annotations

from typing import Callable

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

    def attach(self, worker) -> None:
        self.workers[worker.id] = worker

    def send(self, msg: Message) -> None:
        # names looked up once per message, not once per receiver of a broadcast
        workers, filters, count = self.workers, self.filters, self.count_bytes
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
            schedule(sent + transfer(sender, receiver, nbytes, SERVER_ID), PRIORITY_MESSAGE,
                     _Delivery(worker, msg))


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
