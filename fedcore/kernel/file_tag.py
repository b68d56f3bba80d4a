"""An operator's key that makes snapshots and client states tamper-evident (HMAC-SHA256).

With `checkpoint.hmac_key_file` set, every snapshot a server writes and every state file a
deployed client keeps starts with a tag line, `FCTAG1 <HMAC-SHA256 of the rest, hex>`, keyed
with the bytes of that file; reading one checks the tag before anything in it is parsed, and
refuses (in one line) a file whose tag does not match and a file with no tag. The key
protects against whoever can write the checkpoint or state folder but cannot read the key
file: they cannot make a process resume from a state of their making, nor from another
course's or key's files. It does not hide what the files hold, nor stop the files being
deleted or an older tagged file of the same folder being put back in place of a newer one.
The key itself is never in the config or the outputs, only its path.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import IO, Callable

from fedcore.kernel.errors import ConfigError

__all__ = ["TagError", "load_key", "tag", "untag", "write_tagged", "HEADER", "TAG_BYTES"]

KEY = "checkpoint.hmac_key_file"
HEADER = b"FCTAG1 "
TAG_BYTES = len(HEADER) + 64 + 1     # the header, the hex digest, a newline
MIN_KEY_BYTES = 16


class TagError(ValueError):
    """A file whose tag is missing, wrong, or present where no key is set (one line)."""


def load_key(cfg) -> bytes | None:
    """The key in `checkpoint.hmac_key_file` (None where unset); a missing, empty, short or
    group/other-readable key file is a ConfigError naming the key."""
    path = cfg.get(KEY)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ConfigError(f"{KEY}: cannot read '{path}' ({exc.strerror or exc}); name a key file "
                          "of your own (e.g. 32 random bytes, chmod 600)") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{KEY}: '{path}' is not a regular file")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{KEY}: '{path}' can be read or written by others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        key = fh.read()
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{KEY}: '{path}' holds {len(key)} bytes; a key needs at least "
                          f"{MIN_KEY_BYTES} (e.g. head -c 32 /dev/urandom > FILE)")
    return key


def _line(mac: "hmac.HMAC") -> bytes:
    return HEADER + mac.hexdigest().encode() + b"\n"


def tag(data: bytes, key: bytes) -> bytes:
    """`data` with its tag line in front."""
    return _line(hmac.new(key, data, hashlib.sha256)) + data


def untag(raw: bytes, key: bytes | None) -> bytes:
    """What `raw` holds after its tag line, checked with `key`; with no key, `raw` itself (a
    tagged file is then refused: it would not be checked). TagError says what is wrong."""
    tagged = raw.startswith(HEADER)
    if key is None:
        if tagged:
            raise TagError(f"carries an HMAC tag; set {KEY} to the key that tagged it")
        return raw
    if not tagged or len(raw) < TAG_BYTES or raw[TAG_BYTES - 1:TAG_BYTES] != b"\n":
        raise TagError(f"carries no HMAC tag, and {KEY} is set (untagged files are refused)")
    body = raw[TAG_BYTES:]
    if not hmac.compare_digest(raw[:TAG_BYTES], _line(hmac.new(key, body, hashlib.sha256))):
        raise TagError("fails its HMAC check (altered, or tagged with another key)")
    return body


class _Hashing:
    """A binary file that also feeds what is written to it into an HMAC."""

    def __init__(self, fh: IO[bytes], mac: "hmac.HMAC"):
        self.fh, self.mac = fh, mac

    def write(self, data) -> int:
        self.mac.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def write_tagged(fh: IO[bytes], key: bytes, write: Callable[[IO[bytes]], None]) -> None:
    """`write(file)` into the new file `fh`, with the tag line in front, without holding the
    whole of it in memory (a snapshot may be gigabytes)."""
    fh.write(b"\0" * TAG_BYTES)
    mac = hmac.new(key, digestmod=hashlib.sha256)
    write(_Hashing(fh, mac))   # type: ignore[arg-type]
    fh.flush()
    fh.seek(0)
    fh.write(_line(mac))
    fh.seek(0, os.SEEK_END)
