"""Local data files: the one-line 'missing files' error, checksums and opt-in downloads.

Loaders never touch the network unless `data.download: true`; then each
missing file is fetched from its official location into `data.root` and its
MD5 (the checksum the publishers list) is verified before it is used.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fedcore.kernel.config import declare
from fedcore.kernel.errors import ConfigError

__all__ = ["Remote", "data_root", "find_file", "missing", "md5sum", "verify", "download",
           "ensure", "open_maybe_gzip"]

declare("data.download", bool, False, "fetch missing dataset files from their official locations "
        "into data.root (checksums verified); needs network access")

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Remote:
    """A published file: where it lives and its MD5 as listed by the publisher."""

    url: str
    md5: str

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


def data_root(cfg, dataset: str, where: str) -> Path:
    """`data.root` as a Path, or a one-line error saying what to put there."""
    root = cfg["data.root"]
    if not root:
        raise ConfigError(f"data.root: {dataset} needs data.root=<folder with its files> ({where})")
    return Path(root).expanduser()


def find_file(root: Path, name: str) -> Path | None:
    """`root/name` or `root/name.gz`, whichever exists."""
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def missing(dataset: str, root: Path, names: list[str], where: str) -> ConfigError:
    """The one-line error for files a loader needs and did not find."""
    shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
    return ConfigError(f"data.root: {dataset} files not found in '{root}': expected {shown}; "
                       f"{where}")


def md5sum(path: Path) -> str:
    """The hex MD5 of a file, read in chunks."""
    digest = hashlib.md5(usedforsecurity=False)
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, md5: str) -> None:
    """Raise ConfigError when `path`'s MD5 differs from the published one."""
    got = md5sum(path)
    if got != md5.lower():
        raise ConfigError(f"data.download: checksum mismatch for '{path}' (md5 {got}, expected {md5}); "
                          "delete the file and download it again")


def download(remote: Remote, dest: Path, timeout: float = 60.0) -> Path:
    """Fetch `remote` to `dest` atomically and verify it; a failed fetch is one ConfigError line."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(remote.url, timeout=timeout) as resp:
            for block in iter(lambda: resp.read(_CHUNK), b""):
                out.write(block)
        verify(Path(tmp), remote.md5)
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError) as exc:
        raise ConfigError(f"data.download: cannot fetch {remote.url} ({exc}); download it by hand "
                          f"into '{dest.parent}'") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def ensure(cfg, remotes: list[Remote], root: Path) -> None:
    """With `data.download`, fetch every remote whose file is absent from `root`."""
    if not cfg["data.download"]:
        return
    for remote in remotes:
        target = root / remote.name
        plain = target.with_suffix("") if target.suffix == ".gz" else target
        if not target.is_file() and not plain.is_file():
            download(remote, target)


def open_maybe_gzip(path: Path):
    """Open a file for binary reading, decompressing when it ends in .gz."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")
