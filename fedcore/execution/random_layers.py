"""Dropout under the vectorized engine, with each client's own masks.

A client's sequential fit runs inside `fedcore.kernel.batch_order.client_randomness`,
so an `nn.Dropout` on the CPU draws its mask as
`empty_like(x).bernoulli_(1 - p)` from torch's generator seeded with the
client's round stream, and returns `x * mask / (1 - p)`. `vmap` cannot draw
one such stream per client, so the engine draws the masks itself: a generator
per client, seeded with the same stream, the same draws in the same order
(step by step, and within a step in the order the forward pass calls the
layers), stacked into [clients, batch, ...] tensors. Its copy of the model has
`ReplayedDropout` in place of each `nn.Dropout`, which multiplies by the mask
a `MaskFeed` hands it. Hence the sequential executor's numbers, with dropout
on, for every client of the batch.

On an accelerator `nn.Dropout` would draw with the device's fused kernel, from
the device's generator: numbers the CPU never gives and the engine could not
replay. A course's model on such a device has `StreamDropout` in place of each
`nn.Dropout` (`draw_on_client_stream`, when the course places the model): it
draws its mask on the CPU from the client's stream, exactly as the CPU layer
does, and moves it to the device. So a client's masks depend on the seed, the
client and the round alone - not on the device or the executor - and the
engine replays them on any device.

Other random layers (channel dropout, alpha dropout, RReLU) are named by
`random_layer_reason`, so such a course is known to train one client at a
time before its first round.
"""
from __future__ import annotations

import contextlib
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch
from torch import nn

from fedcore.kernel.batch_order import round_seed
from fedcore.execution.executor import usable_cores

__all__ = ["random_layer_reason", "draw_on_client_stream", "MaskFeed", "ReplayedDropout",
           "StreamDropout"]

_OTHER_RANDOM = (nn.modules.dropout._DropoutNd, nn.RReLU)
_PER_THREAD = 2 ** 18   # mask elements below which another drawing thread costs more than it saves


def random_layer_reason(model: nn.Module, device: torch.device) -> str | None:
    """Why `model`'s random layers keep it from being vectorised, naming the first such
    layer; None if it has none, or only CPU `nn.Dropout`s (which are replayed). A module that
    draws random numbers inside its own functions (not through a layer) says so by a method
    `unreplayed_randomness()` returning why (None or "" when it draws nothing)."""
    for name, m in model.named_modules():
        own = getattr(m, "unreplayed_randomness", None)   # a module that draws without a layer
        why = own() if callable(own) else None
        if why:
            return f"layer {name or 'model'} ({type(m).__name__}): {why}"
        if type(m) is nn.Dropout:
            if device.type != "cpu" and m.p > 0:
                return (f"layer {name} (Dropout) on {device}: the sequential fit draws its mask "
                        "with the device's fused kernel, which the vectorized engine does not replay")
        elif type(m) is StreamDropout:
            continue
        elif isinstance(m, _OTHER_RANDOM):
            return (f"layer {name} ({type(m).__name__}) draws random numbers the vectorized "
                    "engine does not replay")
    return None


class StreamDropout(nn.Dropout):
    """`nn.Dropout` whose training mask comes from torch's CPU generator - the client's stream
    inside a fit - whatever the device of its input: the CPU layer's numbers on every device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        if not self.training or p == 0 or p == 1 or x.device.type == "cpu":
            return super().forward(x)
        mask = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.device.type == "cuda")
        mask.bernoulli_(1 - p).div_(1 - p)   # as the CPU layer draws and scales its noise
        mask = mask.to(x.device, non_blocking=True)
        return x.mul_(mask) if self.inplace else x * mask


def draw_on_client_stream(model: nn.Module) -> nn.Module:
    """Give `model`'s `nn.Dropout` layers their masks from the CPU stream (`StreamDropout`):
    called where a course places its model on an accelerator."""
    for m in model.modules():
        if type(m) is nn.Dropout:
            m.__class__ = StreamDropout
    return model


class ReplayedDropout(nn.Dropout):
    """`nn.Dropout` that multiplies by the mask its feed hands it (or records its input's
    shape while the feed probes the model)."""

    feed: "MaskFeed"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed.take(self, x)


_REPLAYED = (nn.Dropout, StreamDropout)


class MaskFeed:
    """The masks of a batched step, handed to the model's `ReplayedDropout` layers in turn."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._masks: Iterator[torch.Tensor] | None = None
        self._probe: list | None = None
        self._layouts: dict[tuple, list[tuple[float, tuple, torch.dtype]]] = {}

    @classmethod
    def install(cls, model: nn.Module, copied: bool) -> tuple[nn.Module, "MaskFeed | None"]:
        """`model` (copied unless `copied` says it already is a copy) with its `nn.Dropout`s
        replayed, and their feed; `model` itself and None where it has no dropout."""
        if not any(type(m) in _REPLAYED for m in model.modules()):
            return model, None
        if not copied:
            model = copy.deepcopy(model)
        feed = cls(model)
        for m in model.modules():
            if type(m) in _REPLAYED:
                m.__class__ = ReplayedDropout
                m.feed = feed
        return model, feed

    def take(self, layer: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
        if self._probe is not None:
            self._probe.append((layer.p, tuple(x.shape[1:]), x.dtype))
            return x
        if self._masks is None:
            raise RuntimeError("a replayed dropout layer ran without masks")
        return x * next(self._masks)

    @contextlib.contextmanager
    def replaying(self, masks: tuple[torch.Tensor, ...]):
        """Hand out `masks` (one per dropout call of a forward pass, in call order)."""
        self._masks = iter(masks)
        try:
            yield
        finally:
            self._masks = None

    def _layout(self, sample: torch.Tensor) -> list[tuple[float, tuple, torch.dtype]]:
        """(p, per-sample shape, dtype) of each dropout call of a forward pass on `sample`'s
        shape, in call order (one probing forward pass per input shape)."""
        key = (tuple(sample.shape[1:]), sample.dtype)
        layout = self._layouts.get(key)
        if layout is None:
            self._probe = []
            try:
                with torch.no_grad():
                    self.model(sample[:1])
                layout = self._layouts[key] = self._probe
            finally:
                self._probe = None
        return layout

    def draws(self, client_ids: list[int], round_: int, seed: int, sizes: tuple[int, ...],
              sample: torch.Tensor, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        """Each step's masks for the clients of a group, as [clients, batch, ...] tensors on
        `device`: what each client's sequential fit draws in `round_` for batches of `sizes`.
        All are drawn before the first step; for a GPU into page-locked memory, whose copies
        then run without waiting for the GPU. Clients draw from generators of their own, so
        threads draw for different clients at once (torch releases the GIL while it draws):
        on the CPU the draws cost more than a small model's batched GPU step."""
        layout = self._layout(sample)
        pinned = device.type == "cuda"
        n = len(client_ids)
        steps = []   # step by step, layer by layer: the tensor, and whether the clients draw it
        for b in sizes:
            step = []
            for p, shape, dtype in layout:
                if p == 0:   # dropout with p=0 draws nothing and returns its input
                    step.append((torch.ones((n, b) + shape, dtype=dtype, device=device), False))
                    continue
                out = torch.empty((n, b) + shape, dtype=dtype, pin_memory=pinned)
                if p == 1:   # nor does p=1: it zeroes its input
                    out.zero_()
                step.append((out, p < 1))
            steps.append(step)
        keeps = [1 - p for p, _, _ in layout]

        def draw(first: int, last: int) -> None:
            for j in range(first, last):   # client j: its draws in its sequential fit's order
                g = torch.Generator().manual_seed(round_seed(seed, client_ids[j], round_))
                for step in steps:
                    for keep, (out, drawn) in zip(keeps, step):
                        if drawn:
                            out[j].bernoulli_(keep, generator=g).div_(keep)

        elements = sum(out[0].numel() for step in steps for out, drawn in step if drawn)
        threads = min(n, usable_cores(), max(1, n * elements // _PER_THREAD))
        if threads > 1:
            bounds = [n * t // threads for t in range(threads + 1)]
            with ThreadPoolExecutor(threads, thread_name_prefix="fedcore-masks") as pool:
                for done in [pool.submit(draw, a, b) for a, b in zip(bounds, bounds[1:])]:
                    done.result()
        else:
            draw(0, n)
        return [tuple(mask.to(device, non_blocking=pinned) for mask, _ in step) for step in steps]
