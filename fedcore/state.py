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


class DiskStateStore(StateStore):
    """One `torch.save` file per client, read back with `weights_only=True`."""

    def __init__(self, path: str | None = None) -> None:
        self._tmp = path is None
        self.path = Path(path if path is not None else tempfile.mkdtemp(prefix="fedcore-state-"))
        self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, client_id: int) -> Path:
        return self.path / f"client_{client_id}.pt"

    def load(self, client_id: int) -> dict[str, Any]:
        f = self._file(client_id)
        if not f.exists():
            return {}
        return torch.load(f, weights_only=True)

    def save(self, client_id: int, state: dict[str, Any]) -> None:
        f = self._file(client_id)
        if not state:
            f.unlink(missing_ok=True)
            return
        tmp = f.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, f)  # atomic: a crash never leaves a half-written state

    def __contains__(self, client_id: int) -> bool:
        return self._file(client_id).exists()

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.glob("client_*.pt"))

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self.path, ignore_errors=True)


def make_state_store(kind: str, path: str | None) -> StateStore:
    """Build the store named by `state.store`."""
    return DiskStateStore(path) if kind == "disk" else MemoryStateStore()
