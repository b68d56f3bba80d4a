"""A role derived from another: the same handlers except the ones it replaces.

A participant plug-in (a malicious client, say) must not edit the clients'
table: it gets its own role whose lookups fall back to the base role, so the
default table stays as it was and `handlers.txt` shows the new role with only
what it changes.
"""
from __future__ import annotations

import logging
from typing import Iterable

from fedcore.kernel.worker import Handler, HandlerTable, Registration, log

__all__ = ["DerivedTable"]


class DerivedTable(HandlerTable):
    """Handlers of `base`, with this role's own registrations taking precedence."""

    def __init__(self, role: str, base: HandlerTable):
        self.role = role
        self.base = base
        self.own: dict[str, Registration] = {}
        self.overwritten: list[tuple[str, str, str]] = []

    @property
    def observers(self) -> dict[str, list[Handler]]:   # the base role's watchers
        return self.base.observers

    @property
    def entries(self) -> dict[str, Registration]:  # read by dispatch and the completeness check
        return {**self.base.entries, **self.own}

    def register(self, event: str, fn: Handler, sends: Iterable[str] = (), replaces: bool = False,
                 reached_by: str = "") -> None:
        if isinstance(sends, str):
            sends = (sends,)
        new = Registration(event, fn, tuple(sends), reached_by)
        old = self.own.get(event)
        if old is not None and old.fn is not fn:
            log.log(logging.DEBUG if replaces else logging.WARNING, "%s: handler for '%s' replaced: %s -> %s",
                    self.role, event, old.name, new.name)
            self.overwritten.append((event, old.name, new.name))
        self.own[event] = new

    def get(self, event: str) -> Registration | None:
        return self.own.get(event) or self.base.get(event)

    def describe(self) -> str:
        lines = [f"[{self.role}]  (the {self.base.role} handlers, except:)"]
        for event in sorted(self.own):
            reg = self.own[event]
            sends = f"  sends: {', '.join(reg.sends)}" if reg.sends else ""
            base = self.base.get(event)
            instead = f"  (instead of {base.name})" if base is not None else ""
            lines.append(f"  {event} -> {reg.name}{sends}{instead}")
        for event, old, new in self.overwritten:
            lines.append(f"  overwritten: {event}: {old} replaced by {new}")
        return "\n".join(lines)
