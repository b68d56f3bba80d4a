"""A group's local steps on a CUDA GPU, replayed as a CUDA graph.

On a GPU the vectorized engine's steps for a small model are a few hundred small kernels a
round, and launching them from Python costs more than running them (a logistic regression's
batched step: about 3 ms of launches for microseconds of arithmetic). A round's groups have
the same shape round after round - clients, batch sizes, data and mask shapes - so the
second time a shape is seen its whole descent (every step's batch gathering, forward,
backward and SGD update) is captured once as a CUDA graph, and from then on each round
copies its inputs (the received model, the group's samples, batch rows and dropout masks)
into the graph's own buffers and launches it as one unit. The graph runs the very kernels
the eager descent runs, on the same inputs, so its numbers are the eager ones.

Only a descent that reads nothing but these inputs is captured: the base local step, whose
`VectorTerm` adds no per-round constants (an algorithm's term may hold tensors of its own
round, which a graph would keep reading). If capturing fails, one line says why and the
engine runs eagerly from then on.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import torch

__all__ = ["StepGraphs"]

log = logging.getLogger("fedcore.executor")

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, list | None]   # xs, ys, rows, params, masks


def _flat(inputs: Inputs) -> list[torch.Tensor]:
    xs, ys, rows, params, masks = inputs
    return [xs, ys, rows, *params.values(), *(m for step in masks or () for m in step)]


class _Graph:
    """One captured descent: its input buffers, the graph, and its outputs (overwritten by
    each replay)."""

    def __init__(self, run: Callable, key, inputs: Inputs):
        xs, ys, rows, params, masks = inputs
        self.inputs: Inputs = (xs.clone(), ys.clone(), rows.clone(),
                               {n: t.clone() for n, t in params.items()},
                               None if masks is None else [tuple(m.clone() for m in s) for s in masks])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # a warm-up outside the capture, as CUDA graphs need
            self.first = run(key, *self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = run(key, *self.inputs)

    def replay(self, inputs: Inputs) -> tuple[dict, torch.Tensor]:
        for mine, theirs in zip(_flat(self.inputs), _flat(inputs)):
            mine.copy_(theirs)
        self.graph.replay()
        params, loss = self.outputs
        return {n: t.clone() for n, t in params.items()}, loss.clone()


class StepGraphs:
    """Runs `run(key, xs, ys, rows, params, masks) -> (params, loss)` eagerly the first time
    a `key` and shape of inputs is seen, captures it the second, replays it from then on (the
    key holds what else the descent depends on, such as the batch sizes); at most `keep`
    graphs are kept (each holds its own memory), the least recently used dropped first."""

    def __init__(self, run: Callable, keep: int = 4):
        self.run = run
        self.keep = keep
        self.replays = 0
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: set[tuple] = set()
        self._off: str | None = None

    def __call__(self, key, *inputs) -> tuple[dict, torch.Tensor]:
        if self._off is not None:
            return self.run(key, *inputs)
        shape = (key, tuple((t.shape, t.dtype) for t in _flat(inputs)))
        graph = self._graphs.get(shape)
        if graph is not None:
            self._graphs.move_to_end(shape)
            self.replays += 1
            return graph.replay(inputs)
        if shape not in self._seen:
            if len(self._seen) > 64:   # shapes that never repeat: forget them
                self._seen.clear()
            self._seen.add(shape)
            return self.run(key, *inputs)
        try:
            graph = _Graph(self.run, key, inputs)
        except Exception as exc:  # noqa: BLE001 - an operation that cannot be captured
            self._off = f"{type(exc).__name__}: {exc}".splitlines()[0]
            log.warning("executor vectorized: CUDA graphs off (%s); the steps run eagerly", self._off)
            return self.run(key, *inputs)
        self._graphs[shape] = graph
        if len(self._graphs) > self.keep:
            self._graphs.popitem(last=False)
        return graph.first
