"""An algorithm's local step written for a stack of clients (the vectorized executor).

The vectorized executor trains the clients that received the same content
together: their parameters are stacked along a new first dimension and each
SGD step computes all their gradients at once. What an algorithm adds to the
base local step - a gradient term that is a pure function of (parameters,
received content, client state), the payload, the state it keeps - it states
once more, for the whole stack, in a `VectorTerm`, which its trainer returns
from `Trainer.vector_term()`. The executor imports no algorithm: it asks the
trainer.

A term must compute the same floating-point operations as the trainer's own
hooks (`adjust_gradients`, `payload`, ...), so the two executors agree.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["VectorTerm", "stack_state"]


class VectorTerm:
    """The base local step (FedAvg's): no extra gradient term; sends the trained model.

    Stacked tensors have the group's clients along dimension 0, in the order of `states`.
    """

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def names(self) -> list[str]:
        """The parameters the term covers, in the trainer's order; the executor applies only
        when these are all of the trainable parameters."""
        return list(self.trainer.param_names)

    def num_steps(self, client_id: int, n: int, round_: int) -> int:
        """Client `client_id`'s optimizer steps this round, with `n` training samples."""
        return self.trainer.num_steps(n)

    def prepare(self, received: dict, states: list[dict]) -> Any:
        """Per-group constants for `adjust` and `finish` (e.g. stacked per-client tensors)."""
        return None

    def adjust(self, ctx: Any, name: str, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """Every client's gradient of entry `name` after the trainer's `adjust_gradients`
        (may return `grad` itself, or a new tensor; must not modify `param`)."""
        return grad

    def finish(self, ctx: Any, received: dict, params: dict[str, torch.Tensor], steps: int,
               states: list[dict], sizes: list[int]) -> list[tuple[dict, dict]]:
        """Each client's (content, new state) from the stacked trained parameters. The contents
        of one group have one structure (keys, dtypes, shapes) and may differ only in
        `num_samples` (the executor computes their encoded sizes once per sample count)."""
        names = list(params)
        rows = zip(*[params[name].unbind(0) for name in names])   # views, one call per entry
        return [({"model": dict(zip(names, row)), "num_samples": n}, dict(st))
                for row, st, n in zip(rows, states, sizes)]


def stack_state(states: list[dict], key: str, names: list[str],
                like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each client's `state[key][name]` stacked along a new first dimension (zeros where absent)."""
    out = {}
    for n in names:
        zero = None
        rows = []
        for st in states:
            saved = st.get(key)
            if saved is None:
                if zero is None:
                    zero = torch.zeros_like(like[n])
                rows.append(zero)
            else:
                rows.append(saved[n])
        out[n] = torch.stack(rows)
    return out
