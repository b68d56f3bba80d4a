"""What a deployed process's gRPC side hands to its course's scheduler thread. On the server:
a received message, a new session, a lost client; the event loop gathers those of one pass and
hands them over together (`Batch`), waking the scheduler thread once per pass instead of once
per message. On a client: a message from the server, or the error that ends its stream."""
from __future__ import annotations

import logging

from fedcore.kernel.scheduler import HandlerError
from fedcore.kernel.message import SERVER_ID, Message

__all__ = ["Arrival", "Batch", "NewSession", "Lost", "Delivery", "Raise"]


class Arrival:
    """A received message, delivered on the scheduler thread (`session`: the one it came on;
    its first join_in makes it a candidate for rounds, `Session.joining`; a later one is a
    repeat, dropped unseen)."""

    __slots__ = ("comm", "msg", "nbytes", "turn", "session")

    def __init__(self, comm, msg: Message, nbytes: int, turn: object = None, session=None):
        self.comm, self.msg, self.nbytes, self.turn, self.session = comm, msg, nbytes, turn, session

    def __call__(self) -> None:
        comm, msg = self.comm, self.msg
        try:
            if msg.msg_type == "join_in" and self.session is not None:
                if not self.session.joining:
                    return   # a process already in joins again after each redial: nothing new, not counted
                self.session.joining = False
            if self.nbytes:
                comm.count_bytes(msg, SERVER_ID, self.nbytes)
            if msg.msg_type == "join_in":
                comm.quiet_info(f"joined {msg.sender}", f"client {msg.sender} joined the course", logging.INFO)
            elif msg.msg_type == "updates" and not comm.update_gate(msg):
                return
            elif msg.msg_type == "metrics" and not comm.metrics_gate.admit(msg):
                return
            comm.server.deliver(msg)
        finally:   # handled (an update folded) or dropped: the next large message may come in
            self.msg = self.session = None
            if self.turn is not None:
                comm._on_loop(comm._turns.give_back, self.turn)   # nothing once the server stopped
        comm.after_delivery()


class Batch:
    """Events handed over together, run in the order they came; those after one that stopped
    the scheduler are left unrun, as they would have been left in its queue."""

    __slots__ = ("events", "scheduler")

    def __init__(self, events: list, scheduler):
        self.events, self.scheduler = events, scheduler

    def __call__(self) -> None:
        for event in self.events:
            if getattr(self.scheduler, "stopped", False):
                return
            event()


class NewSession:
    """A new session for a client id, on the scheduler thread: a new process, or (`returning`)
    the process whose session was lost, back with the same session id."""

    __slots__ = ("comm", "client_id", "returning")

    def __init__(self, comm, client_id: int, returning: bool = False):
        self.comm, self.client_id, self.returning = comm, client_id, returning

    def __call__(self) -> None:
        self.comm.on_new_session(self.client_id, self.returning)


class Lost:
    __slots__ = ("comm", "client_id", "reason")

    def __init__(self, comm, client_id: int, reason: str):
        self.comm, self.client_id, self.reason = comm, client_id, reason

    def __call__(self) -> None:
        self.comm.on_lost(self.client_id, self.reason)


class Delivery:
    """A message from the server, delivered to the client's worker on its scheduler thread."""

    __slots__ = ("comm", "msg")

    def __init__(self, comm, msg: Message):
        self.comm, self.msg = comm, msg

    def __call__(self) -> None:
        worker, msg = self.comm.worker, self.msg
        try:
            worker.deliver(msg)
        except HandlerError as exc:
            # what the server sent could not be used (a model of another layout, say): the
            # client says so and waits for the next message rather than dying of it
            self.comm.quiet(f"unusable {msg.msg_type}", f"client {self.comm.client_id}: round {msg.round}: "
                            f"the server's '{msg.msg_type}' could not be used ({exc}); skipped",
                            logging.ERROR)
        if getattr(worker, "finished", False):
            self.comm.scheduler.stop()


class Raise:
    """An error of the client's stream thread, raised on its scheduler thread."""

    __slots__ = ("err",)

    def __init__(self, err: Exception):
        self.err = err

    def __call__(self) -> None:
        raise self.err
