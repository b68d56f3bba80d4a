"""Where tensors live: the `device` key, and moving content to and from it.

A course runs its model, its clients' data and states, aggregation and
evaluation on one torch device. Everything that leaves the course - messages
on the wire, checkpoints, the final model, client states kept in the state
store - is on the CPU, so a run on a GPU resumes on a machine without one and
a state store holds no GPU memory per client.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from fedcore.kernel.config import declare, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.state import StateStore

__all__ = ["resolve_device", "to_device", "to_cpu", "DeviceStateStore", "place_data", "made_on_access",
           "apply_determinism"]

CPU = torch.device("cpu")
_SPEC = re.compile(r"auto|cpu|mps|cuda(:\d+)?")

declare("device", str, "cpu",
        "torch device of the model, client data and states, aggregation and evaluation: auto "
        "(cuda if present, else mps, else cpu), cpu, cuda, cuda:N or mps. The default cpu gives "
        "the same numbers on every machine; small models are often faster there too",
        check=lambda v: None if _SPEC.fullmatch(v) else "expected auto, cpu, cuda, cuda:N or mps")
declare("device_data_bytes", int, None,
        "the most bytes of client data kept on a GPU; beyond it data stay in CPU memory and each "
        "mini-batch is moved (default: half the GPU's free memory)", check=lambda v: None if v >= 0
        else "must be >= 0")
declare("torch_deterministic", bool, False,
        "make torch choose deterministic kernels (torch.use_deterministic_algorithms, cuDNN "
        "benchmark off); on CUDA set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment too. "
        "Slower; CPU runs are deterministic without it")


def resolve_device(spec: str) -> torch.device:
    """The torch device for `device: spec`; ConfigError (exit 2) when it is not present."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return CPU
    if spec == "cpu":
        return CPU
    if spec == "mps":
        if not _mps_available():
            raise ConfigError("device: mps is not available on this machine (use device: cpu or auto)")
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise ConfigError(f"device: {spec} but torch sees no CUDA GPU here (torch "
                          f"{torch.__version__}); use device: cpu or auto")
    index = int(spec.split(":")[1]) if ":" in spec else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"device: {spec} but this machine has {count} CUDA GPU(s) "
                          f"(cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


@validator
def _check_device(cfg) -> None:
    resolve_device(cfg["device"])


def apply_determinism(cfg) -> None:
    """`torch_deterministic`: deterministic kernels (raises at a kernel that has none)."""
    if cfg["torch_deterministic"]:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def to_device(obj: Any, device: torch.device) -> Any:
    """`obj` with every tensor in its dicts, lists and tuples on `device`. Tensors already
    there are the same objects (no copy), so on the CPU this changes nothing."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor on the CPU (what checkpoints, files and the wire hold)."""
    return to_device(obj, CPU)


class DeviceStateStore(StateStore):
    """A state store seen from a device: states are kept on the CPU and handed to the trainer
    on its device, so N clients' states cost no GPU memory."""

    def __init__(self, inner: StateStore, device: torch.device):
        self.inner, self.device = inner, device

    def load(self, client_id: int) -> dict[str, Any]:
        return to_device(self.inner.load(client_id), self.device)

    def save(self, client_id: int, state: dict[str, Any]) -> None:
        self.inner.save(client_id, to_cpu(state))

    def __contains__(self, client_id: int) -> bool:
        return client_id in self.inner

    def disk_bytes(self) -> int:
        return self.inner.disk_bytes()

    def close(self) -> None:
        self.inner.close()


def made_on_access(clients) -> bool:
    """Whether a mapping of clients makes each one's data when asked (10^6 clients need no
    resident shards): it cannot list them, so nothing can move or send them all at once."""
    return len(clients.keys()) != len(clients)


def place_data(data, device: torch.device, budget: int | None):
    """`data` with every client's splits and the server's test set on `device` when they fit
    in `budget` bytes (default: half the device's free memory), else `data` itself, whose
    mini-batches the trainer then moves one at a time. The caller's `data` is not changed."""
    if device.type == "cpu":
        return data
    clients = data.clients
    if made_on_access(clients):   # moved batch by batch
        return data
    splits = [s for c in clients.values() for s in (c.train, c.val, c.test)] + [data.server_test]
    size = sum(t.numel() * t.element_size() for s in splits for t in (s.x, s.y))
    if budget is None:
        budget = torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda" else 2 ** 30
    if size > budget:
        return data
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # shared tensors stay shared

    def move(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            moved[id(t)] = (t, t.to(device))    # the original is kept so its id is not reused
        return moved[id(t)][1]

    def split(s):
        return dataclasses.replace(s, x=move(s.x), y=move(s.y))
    return dataclasses.replace(
        data, server_test=split(data.server_test),
        clients={cid: dataclasses.replace(c, train=split(c.train), val=split(c.val),
                                          test=split(c.test)) for cid, c in clients.items()})
