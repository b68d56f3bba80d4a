"""Where the runtime meets a trainer that works in another tensor form.

The runtime (handlers, aggregators, the wire in a torch process) holds torch
tensors. A trainer declares the form it computes in (`tensor_form`, see
`fedcore.wire.tensor_forms`); `at_boundary` leaves a torch trainer as it is and
wraps any other in a `FormBoundary`, which converts what the trainer is given
(the received content and the client's data) into its form and what it
returns back into torch, at this one place. A client's data is converted once
and kept.
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import replace
from typing import Any

from fedcore.kernel.batch_order import NumpyBatchStream  # noqa: F401  (declares train.shuffle)
from fedcore.kernel.config import declare, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrappable
from fedcore.wire.tensor_forms import convert

__all__ = ["at_boundary", "FormBoundary", "RUNTIME_FORM", "BACKEND_TRAINERS", "make_trainer"]

RUNTIME_FORM = "torch"

# train.backend -> "module:class" of its trainer, built from the initial model's entries in the
# trainer's form: Trainer(initial_state, cfg, store). Another backend adds its line here.
BACKEND_TRAINERS = {"numpy": "fedcore.execution.numpy_trainer:NumpyLogRegTrainer"}

declare("train.backend", str, "torch", "the ML backend this process's trainer computes in: torch "
        "(the algorithm's trainer), or numpy (logistic regression with plain SGD; may differ "
        "between the clients of a deployed course)", choices=("torch", *BACKEND_TRAINERS))


@validator
def _check_backend(cfg) -> None:
    if cfg["train.shuffle"] == "numpy" and cfg["executor"] == "vectorized":
        raise ConfigError("train.shuffle: numpy is not supported by executor: vectorized; "
                          "use executor: sequential or processes")
    backend = cfg["train.backend"]
    if backend == "torch":
        return
    needs = {"model.type": "logreg", "algorithm.name": "fedavg", "train.loss": "cross_entropy",
             "train.optimizer.type": "sgd", "train.optimizer.momentum": 0.0,
             "train.optimizer.weight_decay": 0.0, "train.grad_accum_steps": 1,
             "train.scheduler.type": "none", "executor": "sequential", "train.shuffle": "numpy",
             "federate.share_params": None}
    for key, value in needs.items():
        if cfg[key] != value:
            raise ConfigError(f"train.backend: {backend} trains {needs['model.type']} with plain SGD "
                              f"under FedAvg and needs {key}: {value}, not {cfg[key]!r}")


def make_trainer(algorithm, model, cfg, store):
    """This process's trainer: the algorithm's (torch) or `train.backend`'s, at the boundary."""
    backend = cfg["train.backend"]
    if backend == "torch":
        return at_boundary(algorithm.trainer(copy.deepcopy(model), cfg, store))
    module, _, name = BACKEND_TRAINERS[backend].partition(":")
    cls = getattr(importlib.import_module(module), name)
    return at_boundary(cls(convert(model.state_dict(), cls.tensor_form), cfg, store))


def at_boundary(trainer):
    """`trainer` itself if it works in the runtime's form, else it behind a `FormBoundary`."""
    form = getattr(trainer, "tensor_form", RUNTIME_FORM)
    return trainer if form == RUNTIME_FORM else FormBoundary(trainer)


class FormBoundary(Wrappable):
    """A trainer in another tensor form, seen by the runtime as a torch trainer."""

    def __init__(self, trainer):
        self.inner = trainer
        self.tensor_form = RUNTIME_FORM
        self._data: dict[int, Any] = {}

    def __getattr__(self, name: str) -> Any:   # store, cfg, ...: the trainer's own
        return getattr(self.inner, name)

    def _their_data(self, client_id: int, data):
        cached = self._data.get(client_id)
        if cached is None or cached[0] is not data:
            form = self.inner.tensor_form
            splits = {f: getattr(data, f) for f in ("train", "val", "test") if hasattr(data, f)}
            theirs = replace(data, **{f: replace(s, x=convert(s.x, form), y=convert(s.y, form))
                                      for f, s in splits.items()})
            cached = self._data[client_id] = (data, theirs)
        return cached[1]

    def fit(self, client_id: int, data, received: dict, round_: int):
        result = self.inner.fit(client_id, self._their_data(client_id, data),
                                convert(received, self.inner.tensor_form), round_)
        return replace(result, content=convert(result.content, RUNTIME_FORM), sized=None)

    def evaluate(self, client_id: int, data, received: dict) -> dict[str, float]:
        return self.inner.evaluate(client_id, self._their_data(client_id, data),
                                   convert(received, self.inner.tensor_form))
