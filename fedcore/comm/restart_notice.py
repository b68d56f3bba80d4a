"""The launcher's word to its clients that it is restarting their server (`--restart`).

A client gives up on a server gone for `distribute.retry_timeout` (exit code 4). While
`fedcore.launch` restarts the server it started (the restart's delay, then the new process
building and resuming its course until it listens again), the server is not lost but on its
way back: the launcher creates a file for that span, named to its processes in the
environment (`FEDCORE_SERVER_RESTARTING`), and a client does not count that span against its
retry budget. The file sits in a folder only the launch's user can open (removed when the
launch ends, by the launcher or its guardian), so nobody else can hold the clients waiting;
a client started by hand has no such variable and keeps its plain budget.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["RESTARTING_ENV", "server_restarting", "RestartNotice"]

RESTARTING_ENV = "FEDCORE_SERVER_RESTARTING"


def server_restarting() -> bool:
    """Whether this process's launcher says it is restarting the server right now."""
    path = os.environ.get(RESTARTING_ENV)
    return bool(path) and os.path.exists(path)


class RestartNotice:
    """The launcher's side: `begin` when the server died and will be started again, `end`
    once the new one listens (or will not come back)."""

    def __init__(self, folder: Path):
        self.path = folder / "server_restarting"

    @property
    def env(self) -> dict[str, str]:
        """What a launched process needs in its environment to read the notice."""
        return {RESTARTING_ENV: str(self.path)}

    @property
    def active(self) -> bool:
        return self.path.exists()

    def begin(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        os.close(fd)

    def end(self) -> None:
        self.path.unlink(missing_ok=True)
