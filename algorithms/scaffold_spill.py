"""SCAFFOLD's arithmetic a slice at a time, its model-sized operands in files (a simulation
that spills, algorithms/spill.py): the same element-wise operations on the same values as
algorithms/scaffold.py's in memory, so the same results bit for bit, with the process holding
a slice's temporaries instead of c - c_i, c_i, dy_i and dc_i. `self` is a ScaffoldTrainer."""
from __future__ import annotations

import logging

import torch

from fedcore.wire.spooled import blank, release

__all__ = ["STEP", "spill_begin", "add_correction", "spilled_payload", "apply_in_place"]

log = logging.getLogger("fedcore.algorithms.scaffold")

STEP = 2 ** 20   # elements computed at a time where the round spills (a slice's temporaries, 4 MiB)


def slices(t: torch.Tensor):
    return ((s, min(s + STEP, t.numel())) for s in range(0, t.numel(), STEP))


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)


def add_correction(grad: torch.Tensor, corr: torch.Tensor) -> None:
    """grad += corr, a slice of the file at a time (the same additions)."""
    for a, b in slices(corr):
        part = flat(corr)[a:b]
        flat(grad)[a:b].add_(part)
        release(part)


def spill_begin(self, client_state: dict, c: dict, c_i: dict | None) -> bool:
    """c - c_i, and c_i itself, into a file a slice at a time; the state keeps that copy of
    c_i (its values) while the client trains, so the store's in memory goes. False (the
    round in memory) where a tensor is not a contiguous CPU one or the file cannot be made."""
    tensors = [c[n] for n in self.names] + ([] if c_i is None else [c_i[n] for n in self.names])
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    specs = {f"corr.{n}": (tuple(c[n].shape), c[n].dtype) for n in self.names}
    if c_i is not None:
        specs.update({f"c_i.{n}": (tuple(c_i[n].shape), c_i[n].dtype) for n in self.names})
    try:
        files = blank(specs, self.spill_folder)
    except OSError as exc:
        log.warning("aggregator.spill: SCAFFOLD's control variates could not be kept in a file in %s "
                    "(%s); they are kept in memory from now on", self.spill_folder or "the temporary "
                    "folder", exc)
        self._spill = False
        return False
    corr = {n: files[f"corr.{n}"] for n in self.names}
    kept = None if c_i is None else {n: files[f"c_i.{n}"] for n in self.names}
    for n in self.names:
        for a, b in slices(corr[n]):
            cs = flat(c[n])[a:b]
            if kept is None:
                flat(corr[n])[a:b].copy_(cs)
            else:
                ci = flat(c_i[n])[a:b]
                flat(kept[n])[a:b].copy_(ci)
                flat(corr[n])[a:b].copy_(cs - ci)
                release(flat(kept[n])[a:b])
                release(ci)
            release(cs)
            release(flat(corr[n])[a:b])
    self._spilled = {"corr": corr, "c_i": kept}
    if kept is not None:
        client_state["c_i"] = kept   # the same values; the loaded copy goes
    self._correction = []
    return True


def spilled_payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict | None:
    """`payload`'s element-wise operations a slice at a time: dy_i and dc_i written into a
    new file (the fold reads them back a slice at a time, wire/spooled.py), c_i+ into memory
    (the state store keeps it); the working copy is read, not copied. None (`payload` in
    memory) where the file cannot be made."""
    x, c = received["model"], received["control"]
    c_i, y = self._spilled["c_i"], {k: v.detach() for k, v in self.entries.items() if self.shared(k)}
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in list(y.values()) + [x[k] for k in y]):
        return None
    specs = {f"delta.{k}": (tuple(t.shape), t.dtype) for k, t in y.items()}
    specs.update({f"dc.{n}": (tuple(c[n].shape), c[n].dtype) for n in self.names})
    try:
        files = blank(specs, self.spill_folder)
    except OSError as exc:
        log.warning("aggregator.spill: SCAFFOLD's update could not be kept in a file in %s (%s); "
                    "it is made in memory", self.spill_folder or "the temporary folder", exc)
        return None
    delta = {k: files[f"delta.{k}"] for k in y}
    for k in y:
        for a, b in slices(y[k]):
            xs, out = flat(x[k])[a:b], flat(delta[k])[a:b]
            out.copy_(flat(y[k])[a:b] - xs)
            release(xs)
            release(out)
    dc = {n: files[f"dc.{n}"] for n in self.names}
    new_c_i = {n: torch.empty_like(c[n]) for n in self.names}
    for n in self.names:
        for a, b in slices(c[n]):
            cs, xs, ys = flat(c[n])[a:b], flat(x[n])[a:b], flat(y[n])[a:b]
            ci = torch.zeros_like(cs) if c_i is None else flat(c_i[n])[a:b]
            # as `payload`: c_i - c + (x - y) / (sum of step sizes); dc_i = c_i+ - c_i
            new = ci - cs + (xs - ys) / self._lr_sum if steps > 0 else ci.clone()
            flat(new_c_i[n])[a:b].copy_(new)
            out = flat(dc[n])[a:b]
            out.copy_(new - ci)
            for t in (cs, xs, ci, out):
                release(t)
    client_state["c_i"] = new_c_i
    self._spilled = {}
    return {"delta": delta, "delta_control": dc, "num_samples": n_train}


def apply_in_place(t: torch.Tensor, base: torch.Tensor, scale: float | None, divisor: int | None) -> torch.Tensor:
    """t <- base + scale * t, or base + t / divisor, or base + t, in place, a slice at a time:
    the operations of `x + eta_g * mean` and `c + total / N` (addition commutes exactly)."""
    if not (t.is_contiguous() and base.is_contiguous()) or t.shape != base.shape or t.dtype != base.dtype:
        t = t if scale is None else scale * t
        return base + (t if divisor is None else t / divisor)
    for a, b in slices(t):
        part, xs = flat(t)[a:b], flat(base)[a:b]
        if scale is not None:
            part.mul_(scale)
        if divisor is not None:
            part.div_(divisor)
        part.add_(xs)
        release(xs)
        release(part)
    return t
