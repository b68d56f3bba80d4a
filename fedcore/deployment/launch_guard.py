"""The launcher's guardian: ends the launch's processes and removes its secrets when the
launcher dies without doing so itself (SIGKILL, a crash, the OOM killer).

`fedcore.launch` starts it first, as a script (`python -I launch_guard.py`, standard
library only, in a session of its own so that a terminal's Ctrl-C is left to the
launcher), and writes to its stdin `secrets DIR` for each folder of secrets (the tokens,
secure aggregation's signing keys), `pid N` for each process it starts, then `done` when
it has stopped them itself. The end of that pipe is the signal: the kernel closes it
whatever way the launcher ends. Without `done`, every listed process gets SIGTERM (the
course's processes write their outputs on it), then SIGKILL after a grace period; either
way the secrets folders are removed, first.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time

GRACE_S = 5.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a reused pid of another user's: not ours
        return False
    try:  # a zombie has ended; only its exit status is left to collect
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _end(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            if _alive(pid):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        deadline = time.monotonic() + GRACE_S
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    secrets: list[str] = []
    pids: list[int] = []
    done = False
    for line in sys.stdin:  # returns at the pipe's end: the launcher has ended
        word, _, arg = line.strip().partition(" ")
        if word == "pid" and arg.isdigit():
            pids.append(int(arg))
        elif word == "secrets" and arg:
            secrets.append(arg)
        elif word == "done":
            done = True
    for folder in secrets:
        shutil.rmtree(folder, ignore_errors=True)
    if not done:
        _end(pids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
