"""Per-logical-client state: control variates, dual variables, optimizer
moments, sampler positions, history buffers, keyed by client id.

Trainers are shared by many logical clients, so anything a client must keep
between rounds lives here, never on the trainer. `MemoryStateStore` keeps
it in a dict; `DiskStateStore` keeps one file per client so N can be large.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from fedcore.serialization import WireError, from_value, to_value
from fedcore.wire import fedcore_pb2 as pb

__all__ = ["StateStore", "MemoryStateStore", "DiskStateStore", "make_state_store"]


class StateStore:
    """Interface: `load` a client's state dict (empty if new), `save` it back."""

    def load(self, client_id: int) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, client_id: int, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def __contains__(self, client_id: int) -> bool:
        raise NotImplementedError

    def disk_bytes(self) -> int:
        """Bytes this store occupies on disk (0 for memory)."""
        return 0

    def close(self) -> None:
        """Release resources (temporary folders)."""


class MemoryStateStore(StateStore):
    def __init__(self) -> None:
        self._states: dict[int, dict[str, Any]] = {}

    def load(self, client_id: int) -> dict[str, Any]:
        return self._states.get(client_id, {})

    def save(self, client_id: int, state: dict[str, Any]) -> None:
        if state:
            self._states[client_id] = state
        else:
            self._states.pop(client_id, None)

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._states


_MAGIC = b"FCS1"   # a fedcore.serialization Value follows


def _plain(obj: Any, depth: int = 0) -> bool:
    """True for str-keyed dicts whose leaves are tensors, ints or bools (control variates,
    sampler positions): what the compact format holds exactly."""
    if isinstance(obj, dict):
        return depth < 8 and all(isinstance(k, str) and _plain(v, depth + 1) for k, v in obj.items())
    return isinstance(obj, (torch.Tensor, int, bool))


class DiskStateStore(StateStore):
    """One file per client, written atomically (a temporary file, then a rename).

    States made of tensors and integers under string keys (control variates,
    dual variables, sampler positions) are written as one `fedcore.serialization`
    message (`client_<id>.fcs`): no pickle, and reading it back is a parse of
    a few buffers. Anything else (optimizer state with integer keys, scheduler
    floats) is written with `torch.save` (`client_<id>.pt`) and read with
    `weights_only=True`.

    The store keeps an index of the files it holds (read from the folder when it
    opens), so a client without state costs no file-system call; the folder
    belongs to one store at a time.
    """

    def __init__(self, path: str | None = None) -> None:
        self._tmp = path is None
        self.path = Path(path if path is not None else tempfile.mkdtemp(prefix="fedcore-state-"))
        self.path.mkdir(parents=True, exist_ok=True)
        self._kind: dict[int, str] = {}     # client id -> ".fcs" or ".pt"
        with os.scandir(self.path) as entries:
            for e in entries:
                stem, dot, ext = e.name.rpartition(".")
                if stem.startswith("client_") and stem[7:].isdigit() and ext in ("fcs", "pt"):
                    self._kind.setdefault(int(stem[7:]), dot + ext)   # both: the first seen

    def _file(self, client_id: int, suffix: str = ".pt") -> Path:
        return self.path / f"client_{client_id}{suffix}"

    def load(self, client_id: int) -> dict[str, Any]:
        kind = self._kind.get(client_id)
        if kind is None:
            return {}
        if kind == ".pt":
            return torch.load(self._file(client_id), weights_only=True)
        with open(self._file(client_id, ".fcs"), "rb") as fh:
            data = fh.read()
        if not data.startswith(_MAGIC):
            raise WireError(f"{self._file(client_id, '.fcs')} is not a fedcore state file")
        v = pb.Value()
        try:
            v.ParseFromString(memoryview(data)[len(_MAGIC):])
        except Exception as exc:  # noqa: BLE001 - protobuf's parse errors vary by backend
            raise WireError(f"{self._file(client_id, '.fcs')} is damaged: {exc}") from None
        return from_value(v)

    def save(self, client_id: int, state: dict[str, Any]) -> None:
        old = self._kind.pop(client_id, None)
        if not state:
            if old is not None:
                self._file(client_id, old).unlink(missing_ok=True)
            return
        compact = _plain(state)
        kind = ".fcs" if compact else ".pt"
        f = self._file(client_id, kind)
        tmp = f.with_suffix(".tmp")
        if compact:
            with open(tmp, "wb") as fh:
                fh.write(_MAGIC)
                fh.write(to_value(state).SerializeToString())
        else:
            torch.save(state, tmp)
        os.replace(tmp, f)  # atomic: a crash never leaves a half-written state
        self._kind[client_id] = kind
        if old is not None and old != kind:
            self._file(client_id, old).unlink(missing_ok=True)

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._kind

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for pattern in ("client_*.pt", "client_*.fcs")
                   for f in self.path.glob(pattern))

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self.path, ignore_errors=True)


def make_state_store(kind: str, path: str | None) -> StateStore:
    """Build the store named by `state.store`."""
    return DiskStateStore(path) if kind == "disk" else MemoryStateStore()
