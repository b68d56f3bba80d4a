"""FedRep (Collins et al., ICML 2021, Algorithm 1): a shared representation, per-client heads.

The model is split into a representation phi (exchanged) and a head h (kept
by each client in its state, starting from the initial model's head). Each
round a sampled client first takes tau_h steps on its head with phi frozen,
then tau_phi steps on phi with its new head frozen, and sends phi alone; the
server sets phi <- (1/|S|) sum_{i in S} phi_i, the paper's plain average over
the sampled clients. Clients are evaluated with their own head on the
received phi.

tau_h is `algorithm.fedrep.head_steps` (or `head_epochs` epochs); tau_phi is the
round's usual local work (`train.local_steps` or `train.local_epochs`). The
head is `algorithm.fedrep.head` (state-entry patterns), by default the model's
last layer with parameters. Both phases draw from the client's one batch stream.
"""
from __future__ import annotations

import fnmatch
import math

from torch import nn

from fedcore.kernel.config import declare, non_negative
from fedcore.kernel.contract import Aggregator, Algorithm, Trainer
from fedcore.kernel.errors import ConfigError
from fedcore.algorithms.personalization import ExcludeEntries
from fedcore.kernel.registry import algorithms

__all__ = ["FedRepTrainer", "UniformAggregator", "FEDREP", "head_entries"]

declare("algorithm.fedrep.head", list, None,
        "fedrep: state-entry patterns (fnmatch) of the per-client head, which is never sent; "
        "default: the model's last layer with parameters; [] keeps nothing local")
declare("algorithm.fedrep.head_epochs", int, 10,
        "fedrep: tau_h in epochs, the head's training (representation frozen) before the "
        "representation's each round", check=non_negative)
declare("algorithm.fedrep.head_steps", int, None,
        "fedrep: tau_h in steps (overrides head_epochs)", check=non_negative)


def head_entries(model: nn.Module, patterns: list[str] | None) -> set[str]:
    """State-dict names of the head: those matching `patterns`, or the last layer with parameters."""
    names = list(model.state_dict())
    if patterns is None:
        last = [prefix for prefix, m in model.named_modules()
                if any(True for _ in m.parameters(recurse=False))]
        if not last:
            return set()
        prefix = last[-1]
        return {n for n in names if n.rsplit(".", 1)[0] == prefix or (not prefix and "." not in n)}
    head = set()
    for p in patterns:
        matched = {n for n in names if isinstance(p, str) and fnmatch.fnmatchcase(n, p)}
        if not matched:
            raise ConfigError(f"algorithm.fedrep.head: pattern {p!r} matches no entry of the model "
                              f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})")
        head |= matched
    return head


class FedRepTrainer(Trainer):
    """tau_h head steps (representation frozen), then tau_phi representation steps (head frozen)."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.head = head_entries(model, cfg["algorithm.fedrep.head"])
        self.set_shared(ExcludeEntries(self.shared, self.head))
        self._head_params = [n in self.head for n in self.param_names]
        if self._head_params and all(self._head_params):
            raise ConfigError(f"algorithm.fedrep.head: the head takes every trainable parameter of "
                              f"model.type {cfg['model.type']}, so no representation is shared; "
                              "use a model with several layers (e.g. mlp) or name fewer entries")
        self._head_left = 0

    def head_steps(self, n_train: int) -> int:
        """tau_h for a client with `n_train` samples."""
        if not self.head:
            return 0
        if self.cfg["algorithm.fedrep.head_steps"] is not None:
            return self.cfg["algorithm.fedrep.head_steps"]
        batches = self.cfg["algorithm.fedrep.head_epochs"] * math.ceil(n_train / self.cfg["train.batch_size"])
        return math.ceil(batches / self.grad_accum)

    def num_steps(self, n_train: int) -> int:
        return self.head_steps(n_train) + super().num_steps(n_train)

    def fit(self, client_id, data, received, round_):
        self._head_left = self.head_steps(len(data.train))
        try:
            return super().fit(client_id, data, received, round_)
        finally:
            self._freeze(None)

    def _freeze(self, head_phase: bool | None) -> None:
        """Train only the head (True), only the representation (False), or everything (None)."""
        for p, is_head in zip(self.params, self._head_params):
            p.requires_grad_(head_phase is None or is_head == head_phase)

    def _next_phase(self) -> None:
        self._freeze(self._head_left > 0)
        self._head_left -= 1

    def step(self, x, y):
        self._next_phase()
        return super().step(x, y)

    def accumulated_step(self, batches):
        self._next_phase()
        return super().accumulated_step(batches)


class UniformAggregator(Aggregator):
    """The papers' plain average over the sampled clients, 1/|S| sum_i w_i (not sample-weighted);
    a course's staleness discount still applies."""

    def weights(self, updates):
        if self.discount is None:
            return [1.0] * len(updates)
        return [self.discount(u.staleness) for u in updates]


class FedRepAggregator(UniformAggregator):
    """Averages the representation; the heads are never received."""

    def __init__(self, model, cfg, num_clients):
        super().__init__(model, cfg, num_clients)
        self.set_shared(ExcludeEntries(self.shared, head_entries(model, cfg["algorithm.fedrep.head"])))


FEDREP = algorithms.register("fedrep", Algorithm(FedRepTrainer, FedRepAggregator, personalized=True))
