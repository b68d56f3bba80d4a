"""Which client metrics a server takes: answers to the evaluations it asked for, once each.

Without this, a client could send several `{acc: 1.0}` records per round (or
records for rounds it was never asked about) and crowd out honest ones. The
gate notes each evaluation request as it is sent and lets through one finite
answer per client asked; everything else is dropped and counted.
"""
from __future__ import annotations

from typing import Callable

from fedcore.comm.validation import first_nonfinite
from fedcore.kernel.message import SERVER_ID, Message

__all__ = ["MetricsGate"]

KEEP_ROUNDS = 8  # rounds of open requests remembered (older answers count as unrequested)


class MetricsGate:
    def __init__(self, refuse: Callable[[str, str], None]):
        self.refuse = refuse                  # (kind, log line): count and log a dropped message
        self.asked: dict[int, set[int]] = {}  # round -> clients asked, not yet answered

    def sent(self, msg: Message) -> None:
        """Note an outgoing message; an `eval_request` opens one answer per receiver."""
        if msg.msg_type != "eval_request":
            return
        self.asked.setdefault(msg.round, set()).update(r for r in msg.receivers if r != SERVER_ID)
        for old in sorted(self.asked)[:-KEEP_ROUNDS]:
            del self.asked[old]

    def admit(self, msg: Message) -> bool:
        """Whether the `metrics` message `msg` is an open request's answer, with finite numbers."""
        asked = self.asked.get(msg.round, set())
        if msg.sender not in asked:
            self.refuse("unrequested or duplicate metrics", f"round {msg.round}: dropped metrics from "
                        f"client {msg.sender}: no evaluation of this round asked of it is unanswered")
            return False
        asked.discard(msg.sender)
        bad = first_nonfinite(msg.content)
        if bad is not None:
            self.refuse("non-finite metrics", f"round {msg.round}: dropped metrics from client "
                        f"{msg.sender}: {bad} is not finite")
            return False
        return True
