"""Writing a run's files safely: all or nothing, never through a planted link, private by default.

Every file a run writes (snapshots, client states, the final model, summary.json,
metrics.jsonl, config.yaml, ...) goes through `write_atomic` or `open_fresh`. The
temporary file (`<name>.tmp`) is created exclusively and without following links
(O_CREAT | O_EXCL | O_NOFOLLOW): a link or file already at that name (planted, or left by
a killed write) is removed (the name, never what it points at) and the creation tried again,
so whoever can write the folder cannot make the writer overwrite a file elsewhere. The data
is flushed to the disk (fsync), renamed over the final name (a link there is replaced, not
followed) and the folder synced, so a kill at any instant leaves the old file or the new one.

With `outputs.private` (the default) files are created 0600 and the folders a run makes
0700; without it, 0666 and 0777 less the umask. A folder that snapshots or client states are
read from and written to must not be writable by another user: `check_folder` refuses one
that is group- or other-writable or owned by someone else (they could plant or swap files).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Any, Callable

from fedcore.kernel.errors import ConfigError

__all__ = ["set_private", "make_folder", "check_folder", "write_atomic", "open_fresh", "open_append",
           "create_new", "fsync_dir", "restrict_files"]

_private = True
_TRIES = 5   # removals of a name someone keeps re-planting before the write gives up


def set_private(private: bool) -> None:
    """This process's file modes for what a run writes (`outputs.private`)."""
    global _private
    _private = bool(private)


def _file_mode() -> int:
    return 0o600 if _private else 0o666


def make_folder(path: Path | str, key: str | None = None, replace_link: bool = False) -> Path:
    """`path` created (and its missing parents) 0700 where private; with `key`, refused where others may
    write it (see `check_folder`); with `replace_link`, a link at `path` (planted for a third-party
    writer to follow) is removed, never followed, and a folder made in its place."""
    path = Path(path)
    if replace_link and path.is_symlink():
        os.unlink(path)
    missing = []
    while not path.is_dir() and path not in missing and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):   # parents too: mkdir(parents=True) gives them the umask's
        folder.mkdir(exist_ok=True, mode=0o700 if _private else 0o777)
    path = missing[0] if missing else path
    if key is not None:
        check_folder(path, key)
    return path


def restrict_files(folder: Path | str) -> None:
    """The files a third-party writer (TensorBoard) created in `folder`, a folder this run made,
    given this run's mode (0600 where private) instead of the umask's; links are left alone."""
    if not _private:
        return
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, 0o600)


def check_folder(path: Path | str, key: str) -> None:
    """ConfigError (naming `key`) where `path` may be written by a user other than this one."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{key}: folder '{path}' belongs to another user (uid {st.st_uid}), who "
                          "could plant or replace files in it; use a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"{key}: folder '{path}' is writable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}), who could plant or replace files in it; "
                          "chmod go-w it or choose a folder of your own")


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (where the system lets a folder be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_new(tmp: Path | str, flags: int = os.O_WRONLY) -> int:
    """A new file at `tmp`, made here (an fd open with `flags`): whatever was at that name
    before is removed, never followed."""
    flags |= os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_TRIES):
        try:
            return os.open(tmp, flags, _file_mode())
        except FileExistsError:
            os.unlink(tmp)   # a link is removed itself; a folder there raises, a clean failure
    raise OSError(f"cannot create '{tmp}': something keeps re-creating that name")


def write_atomic(path: Path | str, data: bytes | str | Callable[[IO[bytes]], None],
                 before_rename: Callable[[], None] | None = None, tmp: Path | None = None,
                 sync: bool = True) -> Path:
    """`data` (bytes, text, or a function writing to a binary file) as the file `path`, all or
    nothing, through the temporary file `tmp` (default `<name>.tmp`). `before_rename` runs once
    the temporary file is on the disk (tests pause there). `sync=False`: no fsync (scratch
    files that need not survive a power cut, written often)."""
    path = Path(path)
    tmp = tmp if tmp is not None else path.with_name(path.name + ".tmp")
    fd = create_new(tmp)
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
            if before_rename is not None:
                before_rename()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync:
        fsync_dir(path.parent)
    return path


def open_fresh(path: Path | str, mode: str = "w", **kwargs: Any) -> IO[Any]:
    """A new, empty file at `path` open for writing (a stream: metrics.jsonl), replacing what
    was there without following a link or writing into a file hard-linked there."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = create_new(tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        raise
    fsync_dir(path.parent)
    return os.fdopen(fd, mode, **kwargs)


def open_append(path: Path | str, **kwargs: Any) -> IO[Any]:
    """`path`, a file this run made, open to append to; a link put in its place is not followed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    return os.fdopen(fd, "a", **kwargs)
