"""Tensor forms: the translation layer between the wire and a trainer's ML backend.

On the wire a tensor is backend-independent: a dtype name, a shape and its raw
little-endian bytes. A *form* turns that into the tensors of one backend and
back. A trainer declares the form it works in (`Trainer.tensor_form`, "torch"
by default; a numpy trainer says "numpy") and the runtime converts at that one
boundary: the client's communicator decodes received content into it, and
whatever the trainer returns is encoded from it. Another backend (JAX, say)
adds a `TensorForm` subclass and `register_form(...)`s it.

This module imports numpy only. The torch form imports torch when first used,
and recognises a torch tensor only in a process that has already imported
torch (a process without torch cannot hold one), so a client that never uses
torch never imports it.
"""
from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from fedcore.wire.spooled import release

__all__ = ["WIRE_DTYPES", "TensorForm", "NumpyForm", "TorchForm", "register_form", "get_form",
           "form_of", "wire_parts", "convert", "first_nonfinite"]

CHECK_STEP = 2 ** 20   # elements checked for finiteness at a time

# dtype name on the wire -> bytes per element (the names torch and numpy both use)
WIRE_DTYPES: dict[str, int] = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}


class TensorForm:
    """How one backend's tensors cross the wire. Subclasses implement the four methods."""

    name = ""

    def is_tensor(self, obj: Any) -> bool:
        raise NotImplementedError

    def to_wire(self, t: Any) -> tuple[str, tuple[int, ...], memoryview]:
        """(dtype name, shape, a view of its bytes in C order, little-endian); a dtype
        outside WIRE_DTYPES raises ValueError."""
        raise NotImplementedError

    def from_wire(self, dtype: str, shape: tuple[int, ...], data: bytes) -> Any:
        """A new, writable tensor (never a view of `data`); `data` has the right length."""
        raise NotImplementedError

    def all_finite(self, t: Any) -> bool:
        raise NotImplementedError


class NumpyForm(TensorForm):
    name = "numpy"

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, np.ndarray)

    def to_wire(self, t: np.ndarray) -> tuple[str, tuple[int, ...], memoryview]:
        name = t.dtype.name
        if name not in WIRE_DTYPES or t.dtype.kind not in "fiub":
            raise ValueError(f"numpy dtype {t.dtype} is not allowed on the wire")
        if t.dtype.byteorder == ">":
            t = t.astype(t.dtype.newbyteorder("<"))
        return name, tuple(t.shape), memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))

    def from_wire(self, dtype: str, shape: tuple[int, ...], data: bytes) -> np.ndarray:
        if dtype == "bfloat16":
            raise ValueError("a bfloat16 tensor has no numpy form")
        return np.frombuffer(bytearray(data), dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)

    def all_finite(self, t: np.ndarray) -> bool:
        return t.dtype.kind != "f" or bool(np.isfinite(t).all())


class TorchForm(TensorForm):
    name = "torch"

    def is_tensor(self, obj: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(obj, torch.Tensor)

    def to_wire(self, t) -> tuple[str, tuple[int, ...], memoryview]:
        import torch
        name = str(t.dtype).removeprefix("torch.")
        if name not in WIRE_DTYPES:
            raise ValueError(f"tensor dtype {t.dtype} is not allowed on the wire")
        flat = t.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return name, tuple(t.shape), memoryview(flat.contiguous().view(torch.uint8).numpy())

    def from_wire(self, dtype: str, shape: tuple[int, ...], data: bytes):
        import torch
        dt = getattr(torch, dtype)
        if not data:
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape)

    def all_finite(self, t) -> bool:
        import torch
        if not t.is_floating_point():
            return True
        if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64, torch.float16):
            # numpy's check on the same memory: a fraction of torch's per-call cost, which
            # a server pays for every tensor of every update it receives; a slice at a time,
            # so its flags take no quarter of a model and a spooled update's pages go back
            if not t.is_contiguous():
                return bool(np.isfinite(t.detach().numpy()).all())
            flat = t.detach().view(-1)
            for start in range(0, flat.numel(), CHECK_STEP):
                part = flat[start:start + CHECK_STEP]
                finite = np.isfinite(part.numpy()).all()
                release(part)
                if not finite:
                    return False
            return True
        return bool(torch.isfinite(t).all())


_FORMS: dict[str, TensorForm] = {}


def register_form(form: TensorForm) -> None:
    """Make `form` available by its name (a trainer's `tensor_form`)."""
    _FORMS[form.name] = form


register_form(TorchForm())   # first: the common case in a course is checked first
register_form(NumpyForm())


def get_form(name: str) -> TensorForm:
    form = _FORMS.get(name)
    if form is None:
        raise ValueError(f"unknown tensor form {name!r} (known: {sorted(_FORMS)})")
    return form


def form_of(obj: Any) -> TensorForm | None:
    """The form `obj` is a tensor of, or None when it is no tensor."""
    for form in _FORMS.values():
        if form.is_tensor(obj):
            return form
    return None


def wire_parts(obj: Any) -> tuple[str, tuple[int, ...], memoryview] | None:
    """(dtype, shape, bytes) of a tensor of any registered form, or None for a non-tensor."""
    form = form_of(obj)
    return form.to_wire(obj) if form is not None else None


def convert(content: Any, to: str) -> Any:
    """`content` with every tensor (of any form) turned into form `to`; other values as they are.
    A tensor already in form `to` is passed through, not copied."""
    target = get_form(to)
    if isinstance(content, dict):
        return {k: convert(v, to) for k, v in content.items()}
    if isinstance(content, (list, tuple)):
        return type(content)(convert(v, to) for v in content)
    form = form_of(content)
    if form is None or form is target:
        return content
    dtype, shape, data = form.to_wire(content)
    return target.from_wire(dtype, shape, data.tobytes())


def first_nonfinite(content: Any, path: str = "content") -> str | None:
    """The path of the first non-finite number or floating-point tensor in `content`, or None."""
    if isinstance(content, float):
        return None if math.isfinite(content) else path
    if isinstance(content, dict):
        items = content.items()
    elif isinstance(content, (list, tuple)):
        items = enumerate(content)
    else:
        form = form_of(content)
        return None if form is None or form.all_finite(content) else path
    for k, v in items:
        found = first_nonfinite(v, f"{path}.{k}")
        if found is not None:
            return found
    return None
