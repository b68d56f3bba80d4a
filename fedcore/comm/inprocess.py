"""Simulation: messages become events on the shared scheduler, timed by the time model.

Content is passed by reference (no copies, no serialization); the bytes a
message would take on the wire are computed exactly and counted.
"""
from __future__ import annotations

from typing import Callable

from fedcore.message import SERVER_ID, Message
from fedcore.scheduler import PRIORITY_MESSAGE, Scheduler
from fedcore.timing import TimeModel

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
        for receiver in msg.receivers:
            worker = self.workers.get(receiver)
            if worker is None:
                raise KeyError(f"message '{msg.msg_type}' from {msg.sender} to unknown worker {receiver}")
            if any(not keep(msg, receiver) for keep in self.filters):
                continue  # e.g. a dropped-out client's reply never arrives
            nbytes = msg.nbytes_to(receiver)
            self.count_bytes(msg, receiver, nbytes)
            arrival = msg.timestamp + self.timing.transfer_time(msg.sender, receiver, nbytes, SERVER_ID)
            self.scheduler.schedule(arrival, PRIORITY_MESSAGE, _Delivery(worker, msg))


class _Delivery:
    """A scheduled arrival; a class rather than a closure keeps it cheap and inspectable."""

    __slots__ = ("worker", "msg")

    def __init__(self, worker, msg: Message):
        self.worker = worker
        self.msg = msg

    def __call__(self) -> None:
        self.worker.deliver(self.msg)
