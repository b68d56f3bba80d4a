"""Workers: a handler table, a clock, and a way to send.

A worker does not know which algorithm runs: it dispatches events to the
handlers registered for them. Message events are named `receiving_<type>`;
condition events (`all_received`, `goal_achieved`, ...) are raised by
handlers with `trigger`. Each handler declares what it `sends` (message types
and condition events) so the completeness checker can draw the course.
"""
from __future__ import annotations

import logging
import time as _time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from fedcore.kernel.message import SERVER_ID, Message, receiving
from fedcore.kernel.scheduler import PRIORITY_TIMER, HandlerError
from fedcore.kernel.server_state import StateHolder, WorkerStates

__all__ = ["Handler", "HandlerTable", "Worker", "Server", "Client", "handler_name"]

log = logging.getLogger("fedcore.worker")

Handler = Callable[["Worker", Any], None]


_EVENTS: dict[str, str] = {}   # message type -> the event its arrival raises (made once per type)


def handler_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True, slots=True)
class Registration:
    event: str
    fn: Handler
    sends: tuple[str, ...]
    # who raises the event when no handler of the flow sends it (a guard against a peer that
    # breaks the protocol, or the runtime itself): the completeness check says so instead of
    # warning that the handler is never reached
    reached_by: str = ""

    @property
    def name(self) -> str:
        return handler_name(self.fn)


class HandlerTable:
    """The `<event, handler>` pairs of one worker role; shared by that role's logical clients."""

    def __init__(self, role: str):
        self.role = role
        self.entries: dict[str, Registration] = {}
        self.overwritten: list[tuple[str, str, str]] = []  # (event, old, new)
        self.observers: dict[str, list[Handler]] = {}

    def register(self, event: str, fn: Handler, sends: Iterable[str] = (), replaces: bool = False,
                 reached_by: str = "") -> None:
        """Register `fn` for `event`; a second registration replaces the first, with a warning
        unless it says it `replaces` one (a behaviour's own version of a default handler).
        Either way handlers.txt lists the replacement. `reached_by` names what raises the event
        outside the declared flow (see `Registration`)."""
        if isinstance(sends, str):
            sends = (sends,)
        new = Registration(event, fn, tuple(sends), reached_by)
        old = self.entries.get(event)
        if old is not None and old.fn is not fn:
            log.log(logging.DEBUG if replaces else logging.WARNING, "%s: handler for '%s' replaced: %s -> %s",
                    self.role, event, old.name, new.name)
            self.overwritten.append((event, old.name, new.name))
        self.entries[event] = new

    def get(self, event: str) -> Registration | None:
        return self.entries.get(event)

    def observe(self, event: str, fn: Handler) -> None:
        """Call `fn(worker, payload)` before whichever handler `event` has, now or registered
        later: a behaviour that watches an event without handling it (what DP's accounting
        counts as a release is every update received, refused ones included). It sends nothing."""
        self.observers.setdefault(event, []).append(fn)

    def describe(self) -> str:
        """The handlers.txt section for this role."""
        lines = [f"[{self.role}]"]
        for event in sorted(self.entries):
            reg = self.entries[event]
            sends = f"  sends: {', '.join(reg.sends)}" if reg.sends else ""
            lines.append(f"  {event} -> {reg.name}{sends}")
        for event, old, new in self.overwritten:
            lines.append(f"  overwritten: {event}: {old} replaced by {new}")
        for event in sorted(self.observers):
            lines.append(f"  observed: {event} by {', '.join(handler_name(f) for f in self.observers[event])}")
        return "\n".join(lines)


class Worker(StateHolder):
    """A participant: its id, handler table, communicator and clock.

    `now` is the time of the event being handled at this worker; `spend`
    advances it by modelled (or measured) compute time, so a message sent
    after local work is stamped when the work is done. What behaviours keep on it between
    events is in `states`, read with `self.state(Cls)` (`fedcore.kernel.server_state`).
    """

    role = "worker"
    parent = SERVER_ID   # whom it reports to: the server, or in a tree its edge aggregator

    def __init__(self, worker_id: int, table: HandlerTable, course: Any):
        self.id = worker_id
        self.handlers = table
        self.course = course  # scheduler, comm, time model, monitor, config
        self.now = 0.0
        self.busy_until = 0.0
        self.round = 0
        self.states = WorkerStates()

    # ------------------------------------------------------------ registry
    def register(self, event: str, fn: Handler, sends: Iterable[str] = ()) -> None:
        self.handlers.register(event, fn, sends)

    # ------------------------------------------------------------ dispatch
    def _dispatch(self, event: str, payload: Any) -> None:
        reg = self.handlers.entries.get(event)
        if reg is None:
            log.warning("%s %d: no handler for event '%s'; ignored", self.role, self.id, event)
            return
        try:
            watchers = self.handlers.observers.get(event)
            if watchers:
                for watch in watchers:
                    watch(self, payload)
            reg.fn(self, payload)
        except HandlerError:
            raise
        except Exception as exc:
            round_ = payload.round if isinstance(payload, Message) else self.round
            raise HandlerError(
                f"handler {reg.name} for event '{event}' on {self.role} {self.id} "
                f"(round {round_}) raised {type(exc).__name__}: {exc}") from exc

    def deliver(self, msg: Message) -> None:
        """A message arrived (called by the scheduler at its arrival time)."""
        clock = self.course.scheduler.now
        self.now = clock if clock > self.busy_until else self.busy_until
        event = _EVENTS.get(msg.msg_type)
        if event is None:
            event = _EVENTS[msg.msg_type] = receiving(msg.msg_type)
        reg = self.handlers.entries.get(event)
        if reg is None:
            self._dispatch(event, msg)   # logs the missing handler
            return
        try:   # `_dispatch`, inlined: this runs for every message
            watchers = self.handlers.observers.get(event)
            if watchers:
                for watch in watchers:
                    watch(self, msg)
            reg.fn(self, msg)
        except HandlerError:
            raise
        except Exception as exc:
            raise HandlerError(
                f"handler {reg.name} for event '{event}' on {self.role} {self.id} "
                f"(round {msg.round}) raised {type(exc).__name__}: {exc}") from exc

    def trigger(self, event: str, payload: Any = None) -> None:
        """Raise a condition event now, at this worker's current time."""
        self._dispatch(event, payload)

    def set_timer(self, delay: float, event: str, payload: Any = None) -> None:
        """Raise `event` after `delay` seconds of (virtual or wall) time."""
        due = self.now + delay

        def fire() -> None:
            self.now = self.course.scheduler.now
            self._dispatch(event, payload)
        self.course.scheduler.schedule(due, PRIORITY_TIMER, fire)

    # ------------------------------------------------------------ time and sending
    def spend(self, work: float, measured: float = 0.0) -> float:
        """Charge `work` gradient evaluations to this worker's clock; returns the seconds."""
        seconds = self.course.timing.compute_time(self.id, work, measured)
        self.now += seconds
        self.busy_until = self.now
        return seconds

    def send(self, msg_type: str, receivers: int | Iterable[int], content: Any = None,
             round_: int | None = None, content_size: int | None = None) -> Message:
        """Send a message stamped with this worker's current time (`content_size`: the
        content's encoded size where the caller already knows it, e.g. `FitResult.content_size`)."""
        msg = Message(msg_type, self.id, receivers, self.round if round_ is None else round_,
                      self.now, content, -1 if content_size is None else content_size)
        self.course.comm.send(msg)
        return msg


class Server(Worker):
    role = "server"

    def __init__(self, table: HandlerTable, course: Any):
        super().__init__(SERVER_ID, table, course)


class Client(Worker):
    role = "client"

    def __init__(self, client_id: int, table: HandlerTable, course: Any, data: Any = None):
        super().__init__(client_id, table, course)
        self.data = data


class Stopwatch:
    """Measures wall seconds of local work for `time.mode: measured`."""

    def __enter__(self) -> "Stopwatch":
        self.t0 = _time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = _time.perf_counter() - self.t0
