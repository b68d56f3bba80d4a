"""Snapshot files on disk: written so that a kill at any instant leaves one that loads.

A snapshot is written (through `fedcore.kernel.files`: created exclusively, no link
followed, 0600 where `outputs.private`) to `round_<k>.tmp`, flushed to the disk (fsync), renamed
to `round_<k>.pt` and the folder synced; only then does the `latest` pointer
(a one-line text file, replaced the same way) name it, and only then are
snapshots older than the newest `keep` removed. A process killed mid-write
leaves at most a `.tmp` file, never a half-written `round_<k>.pt` or pointer.
Reading `latest` tries the snapshots newest first: one that does not load
(truncated, corrupted by the disk) is refused with one line and the one
before it is used. Files are read with `weights_only=True`, never unpickled.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.file_tag import write_tagged
from fedcore.kernel.files import make_folder, write_atomic

__all__ = ["LATEST", "PAUSE_ENV", "interrupts_deferred", "write_snapshot", "snapshots", "in_run_folder", "resolve", "newest_loadable"]

log = logging.getLogger("fedcore.checkpoint")

LATEST = "latest"
# tests: "ROUND:SECONDS" sleeps that long in the write of that round's snapshot, its temp file
# written and not yet renamed (a kill then is a kill during the write); "ROUND:SECONDS:after"
# sleeps once it is complete, before the server goes on (to broadcast the next round)
PAUSE_ENV = "FEDCORE_TEST_PAUSE_IN_SNAPSHOT"


def _write_durably(path: Path, write: Callable[[Any], None]) -> None:
    write_atomic(path, write, before_rename=lambda: _test_pause(path, ""), tmp=path.with_suffix(".tmp"))


def _test_pause(path: Path, phase: str) -> None:
    round_, seconds, when = (os.environ.get(PAUSE_ENV, "").split(":") + ["", "", ""])[:3]
    if seconds and when == phase and path.name == f"round_{round_}.pt":
        print(f"fedcore: test pause {'after' if phase else 'in'} the snapshot write of {path.name}",
              flush=True)
        time.sleep(float(seconds))


@contextmanager
def interrupts_deferred():
    """Ctrl-C or SIGTERM during a write takes effect once the write is done: an interrupt
    raised inside torch.save comes out as another error, and the interrupted server would
    then exit as failed instead of snapshotting its last round and printing how to resume.
    Nested, the inner one hands what it caught to the outer one."""
    watched = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    if threading.current_thread() is not threading.main_thread() or not watched:
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in watched}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])   # now, to the handler the process had


def snapshots(folder: Path) -> list[tuple[int, Path]]:
    """(round, path) of the complete snapshots in `folder`, oldest first."""
    found = []
    for f in folder.glob("round_*.pt"):
        if f.stem[6:].isdigit():
            found.append((int(f.stem[6:]), f))
    return sorted(found)


def write_snapshot(state: dict, folder: Path, round_: int, keep: int, key: bytes | None = None) -> Path:
    """Write `state` as `folder/round_<round_>.pt` (tagged with `key`, see
    `fedcore.kernel.file_tag`), point `latest` at it, then keep only the newest `keep`
    snapshots (0: all). Returns its path."""
    make_folder(folder, "checkpoint.path")
    path = folder / f"round_{round_}.pt"
    with interrupts_deferred():
        if key is None:
            _write_durably(path, lambda fh: torch.save(state, fh))
        else:
            _write_durably(path, lambda fh: write_tagged(fh, key, lambda f: torch.save(state, f)))
        _write_durably(folder / LATEST, lambda fh: fh.write(f"{path.name}\n".encode()))
        if keep:
            for _, old in snapshots(folder)[:-keep]:
                if old != path:
                    old.unlink(missing_ok=True)
    _test_pause(path, "after")
    return path


def in_run_folder(folder: Path) -> str:
    """The snapshot a run folder given as `resume_from` stands for: the newest complete
    `round_<k>.pt` in its `checkpoints` folder (where `latest` points, unless a kill came
    between the two), else in the folder itself (a checkpoint folder named directly)."""
    for place in (folder / "checkpoints", folder):
        found = snapshots(place)
        if found:
            return str(found[-1][1])
    raise ConfigError(f"resume_from: no snapshot in the folder '{folder}': looked for round_<k>.pt "
                      f"(and the latest pointer) in '{folder / 'checkpoints'}' and in '{folder}'; "
                      "name a round_<k>.pt file, or a run folder whose course wrote checkpoints")


def resolve(value: str, folder: Path | None) -> str:
    """`resume_from` as a file: `latest` is the newest snapshot in `folder`; a folder is the
    newest snapshot of that run (`in_run_folder`)."""
    if value != LATEST:
        return in_run_folder(Path(value)) if Path(value).is_dir() else value
    if folder is None:
        raise ConfigError("resume_from: latest needs outdir or checkpoint.path to find the snapshots in")
    found = snapshots(folder)
    if not found:
        raise ConfigError(f"resume_from: latest: no snapshot in '{folder}' (written every "
                          "checkpoint.every rounds, and on Ctrl-C or SIGTERM)")
    # a round_<k>.pt exists only once complete, so the newest is the one to resume (the
    # `latest` pointer names it too, unless the kill came between its rename and the pointer's)
    return str(found[-1][1])


def newest_loadable(path: str, load: Callable[[str], Any]) -> tuple[str, Any]:
    """`load(path)`; where that fails and `path` is a snapshot with older ones beside it, say so
    in one line and try those, newest first. Returns (the path loaded, what it held)."""
    try:
        return path, load(path)
    except ConfigError as first:
        p = Path(path)
        older = [f for r, f in reversed(snapshots(p.parent)) if f != p and round_of(p) is not None
                 and r < round_of(p)]
        for candidate in older:
            log.warning("%s; using the snapshot before it, %s", first, candidate)
            try:
                return str(candidate), load(str(candidate))
            except ConfigError as exc:
                first = exc
        raise first from None


def round_of(path: Path) -> int | None:
    """k of a file named round_<k>.pt (None for any other name)."""
    stem = path.stem
    return int(stem[6:]) if stem.startswith("round_") and stem[6:].isdigit() else None
