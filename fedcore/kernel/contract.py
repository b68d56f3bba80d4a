"""The plug-in interfaces: `Trainer` (client side) and `Aggregator` (server side).

A `Trainer` serves many logical clients with one model instance: for each
client it loads the received global state in place, restores that client's
own state from the state store, runs the local objective for exactly the
configured number of optimizer steps, and returns the payload to send. Hooks
(`begin`, `objective`, `adjust_gradients`, `step`, `payload`) are where an
algorithm changes the local objective or the update it sends.

Behaviours change `fit`, `evaluate`, `aggregate` or `broadcast` by wrapping them
(`fedcore.kernel.hooks`: `plugin.wrap(Wrapper(...))`), never by replacing them.

An `Aggregator` owns the global state and turns received updates into the
next one. It never mutates a tensor it has broadcast: each aggregation
builds new tensors, so in-flight messages stay valid.
"""
from __future__ import annotations

import fnmatch
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from fedcore.kernel.batch_order import BatchStream
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrappable
from fedcore.kernel.inner_loop import build_scheduler
from fedcore.kernel.model_ops import clone_tree, evaluate_model, model_device, weighted_mean
from fedcore.kernel.sgd_step import clear_grads, plain_sgd, sgd_update
from fedcore.kernel.state import StateStore
from fedcore.kernel.vector_term import VectorTerm
from fedcore.wire.spooled import copy_released

__all__ = ["Algorithm", "Trainer", "Aggregator", "FitResult", "ReceivedUpdate", "BatchStream",
           "ShareFilter", "weighted_mean", "evaluate_model", "clone_tree", "model_device",
           "UpdateLayout", "LayoutChange"]


# What a client's update carries, as a deployed server checks it before any handler sees it:
# (server) -> {content key: expected}, `expected` either a map {entry: reference tensor} that
# the update's map must match exactly (names, shapes, dtypes; finite values) or a check
# (value, server) -> problem or None for content of another kind; 'num_samples' is implied.
UpdateLayout = Callable[[Any], "dict[str, Any]"]
# A behaviour that adds to or re-encodes what clients send declares the change on its install
# function, as it declares `enabled`: `install.update_layout` (server, layout) -> the layout
# its course's clients send; `install.message_checks` {message type: (content, server) ->
# problem or None} for the message types it adds.
LayoutChange = Callable[[Any, "dict[str, Any]"], "dict[str, Any]"]


@dataclass(frozen=True)
class Algorithm:
    """A named pair of plug-ins, and the layout of the updates its clients send."""

    trainer: type
    aggregator: type
    update_layout: UpdateLayout | None = None   # None: the global model's shared entries ('model')
    # clients are evaluated with models of their own, so the global model's accuracy is not
    # the method's: the course's last line leads with the clients' (personalized) accuracy
    personalized: bool = False


@dataclass
class FitResult:
    content: dict[str, Any]      # exactly what the client sends
    work: float                  # gradient evaluations (samples through forward+backward)
    metrics: dict[str, float] = field(default_factory=dict)
    # (content, its encoded size) where the maker knew the size without walking the content
    sized: tuple[Any, int] | None = field(default=None, repr=False, compare=False)

    @property
    def content_size(self) -> int | None:
        """The encoded size of `content` if its maker knew it, else None. It holds only for
        the very object it was given with: a wrapper that replaces `content` drops it."""
        sized = self.sized
        return sized[1] if sized is not None and sized[0] is self.content else None


@dataclass
class ReceivedUpdate:
    client_id: int
    content: dict[str, Any]
    round: int                   # the round of the global model the client started from
    staleness: int = 0           # rounds between that model and the current one
    # its tensors were made for this aggregation alone (a folding round's mean): an aggregator
    # may adopt them as the new global state instead of copying them
    owned: bool = False


class ShareFilter:
    """Which state entries are exchanged (`federate.share_params` patterns; all by default)."""

    def __init__(self, patterns: list[str] | None):
        self.patterns = list(patterns) if patterns else None

    def __call__(self, name: str) -> bool:
        return self.patterns is None or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)


class Trainer(Wrappable):
    """Client-side local training shared by logical clients (FedAvg's local SGD by default)."""

    tensor_form = "torch"   # the tensors it works in; another form is converted at the boundary

    def __init__(self, model: nn.Module, cfg, store: StateStore):
        self.model = model
        self.cfg = cfg
        self.store = store
        self.loss = cfg["train.loss"]
        self.shared = ShareFilter(cfg["federate.share_params"])
        self.entries: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
        self.device = model_device(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        # Entries that stay local start from the initial model for every client.
        self._local_init = {k: v.detach().clone() for k, v in self.entries.items() if not self.shared(k)}
        self.optimizer = self._build_optimizer()
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.grad_accum = cfg["train.grad_accum_steps"]
        # What a client without saved state starts from (another client may have changed the LR).
        self._fresh_groups = [{k: v for k, v in g.items() if k != "params"}
                              for g in self.optimizer.param_groups]
        self._fresh_scheduler = self.scheduler.state_dict() if self.scheduler is not None else None

    def set_shared(self, shared) -> None:
        """Change which entries are exchanged (a `ShareFilter`-like callable) before any round;
        the others start from the initial model and stay in each client's state."""
        self.shared = shared
        self._local_init = {k: v.detach().clone() for k, v in self.entries.items() if not shared(k)}
        self.shared_changed()

    def shared_changed(self) -> None:
        """Hook: `self.shared` changed; recompute whatever was derived from it (the entries an
        algorithm regularises or corrects)."""

    # ------------------------------------------------------------ set-up
    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.section("train.optimizer")
        if o["type"] == "sgd":
            return torch.optim.SGD(self.params, lr=o["lr"], momentum=o["momentum"],
                                   weight_decay=o["weight_decay"])
        cls = torch.optim.Adam if o["type"] == "adam" else torch.optim.AdamW
        return cls(self.params, lr=o["lr"], weight_decay=o["weight_decay"])

    def num_steps(self, n_train: int) -> int:
        """Optimizer steps this round: `train.local_steps`, or epochs x batches per epoch
        (divided by `train.grad_accum_steps`, rounded up)."""
        if self.cfg["train.local_steps"] is not None:
            return self.cfg["train.local_steps"]
        batches = self.cfg["train.local_epochs"] * math.ceil(n_train / self.cfg["train.batch_size"])
        return math.ceil(batches / self.grad_accum)

    # ------------------------------------------------------------ state in and out
    @torch.no_grad()
    def load_global(self, model_state: dict[str, torch.Tensor], client_state: dict) -> None:
        """Copy received entries into the shared model in place (a parked global model a slice
        at a time, wire/spooled.py); restore local entries."""
        for name, t in model_state.items():
            copy_released(self.entries[name], t)
        if self._local_init:
            local = client_state.get("local_params", self._local_init)
            for name, t in local.items():
                self.entries[name].copy_(t)

    def shared_state(self) -> dict[str, torch.Tensor]:
        """Fresh copies of the exchanged entries (the model is reused by the next client)."""
        return {k: v.detach().clone() for k, v in self.entries.items() if self.shared(k)}

    def _save_local(self, client_state: dict) -> None:
        if self._local_init:
            client_state["local_params"] = {k: self.entries[k].detach().clone() for k in self._local_init}

    # ------------------------------------------------------------ hooks
    def begin(self, client_state: dict, received: dict) -> None:
        """Called after the global state is loaded, before the first step."""

    def objective(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The local loss on one mini-batch."""
        out = self.model(x)
        if self.loss == "mse":
            return nn.functional.mse_loss(out.reshape(y.shape), y)
        return nn.functional.cross_entropy(out, y)

    def adjust_gradients(self) -> None:
        """Called between backward and the optimizer step (gradient corrections)."""

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """One optimizer step; returns (loss, gradient evaluations spent)."""
        self._zero_grad()
        loss = self.objective(x, y)
        loss.backward()
        self.adjust_gradients()
        self._optimizer_step()
        return loss.item(), float(len(y))

    def accumulated_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One optimizer step on several micro-batches (`train.grad_accum_steps` > 1).

        Each micro-batch loss is weighted by its share of the samples, so the gradient is
        that of the mean loss over their union; returns (that loss, gradient evaluations).
        """
        self._zero_grad()
        total = sum(len(y) for _, y in batches)
        loss_sum = 0.0
        for x, y in batches:
            loss = self.objective(x, y) * (len(y) / total)
            loss.backward()
            loss_sum += loss.item()
        self.adjust_gradients()
        self._optimizer_step()
        return loss_sum, float(total)

    def _zero_grad(self) -> None:
        if plain_sgd(self.optimizer):
            clear_grads(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> None:
        """`optimizer.step()`, or plain SGD's arithmetic alone where nothing can tell the
        difference (`fedcore.kernel.sgd_step`: the same operation, a third of the step's time)."""
        if plain_sgd(self.optimizer):
            sgd_update(self.optimizer)
        else:
            self.optimizer.step()

    def end(self, client_state: dict, received: dict, steps: int) -> None:
        """Called once after the last of the round's `steps` optimizer steps, before the
        payload is built and the client's state saved (also when `steps` is 0)."""

    def payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict[str, Any]:
        """What the client sends after local training."""
        return {"model": self.shared_state(), "num_samples": n_train}

    def vector_term(self) -> VectorTerm | None:
        """Hook: this trainer's local step for a stack of clients (the vectorized executor), or
        None if it has none. A subclass that changes the local step overrides this too: the
        executor uses the form of the nearest class that defines it, and only if no class in
        between defines anything of its own (otherwise it trains one client at a time)."""
        return VectorTerm(self)

    # ------------------------------------------------------------ the round
    def fit(self, client_id: int, data, received: dict, round_: int) -> FitResult:
        """Train logical client `client_id` from `received` and return what it sends."""
        state = self.store.load(client_id)
        self.load_global(received["model"], state)
        self._restore_optimizer(state)
        self.begin(state, received)
        train = data.train
        pos = state.get("sampler", {"epoch": 0, "offset": 0})
        stream = BatchStream(len(train), self.cfg["train.batch_size"], self.cfg["seed"], client_id,
                             pos["epoch"], pos["offset"], self.cfg["train.shuffle"])
        steps = self.num_steps(len(train)) if len(train) else 0
        work, loss_sum = 0.0, 0.0
        self.model.train()
        batch = self._batch_on_device if train.x.device != self.device else _batch
        for _ in range(steps):
            if self.grad_accum == 1:
                loss, w = self.step(*batch(train, stream.next()))
            else:
                idxs = [stream.next() for _ in range(self.grad_accum)]
                loss, w = self.accumulated_step([batch(train, i) for i in idxs])
            if self.scheduler is not None:
                with warnings.catch_warnings():  # trainers that step by hand (FedMoS) skip optimizer.step
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                    self.scheduler.step()
            loss_sum += loss
            work += w
        state["sampler"] = stream.position()
        self.end(state, received, steps)
        # the last step's gradients: a model's worth of memory while a large update is built and sent
        self.model.zero_grad(set_to_none=True)
        content = self.payload(state, received, steps, len(train))
        self._save_optimizer(state)
        self._save_local(state)
        self.store.save(client_id, state)
        metrics = {"train_loss": loss_sum / steps} if steps else {}
        return FitResult(content, work, metrics)

    def _batch_on_device(self, split, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A mini-batch of data kept in CPU memory, moved to the model's device."""
        x, y = _batch(split, idx)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _restore_optimizer(self, state: dict) -> None:
        """Swap in this client's optimizer (and scheduler) state, or a fresh one."""
        self.optimizer.state.clear()
        for group, fresh in zip(self.optimizer.param_groups, self._fresh_groups):
            group.update(fresh)
        keep = self.cfg["train.preserve_optimizer_state"]
        # Load copies: the optimizer updates its state in place, and the stored snapshot must
        # stay as saved if this fit fails half-way.
        if keep and "optimizer" in state:
            self.optimizer.load_state_dict(clone_tree(state["optimizer"]))
        if self.scheduler is not None:
            saved = state.get("scheduler") if keep else None
            self.scheduler.load_state_dict(clone_tree(saved if saved is not None else self._fresh_scheduler))

    def _save_optimizer(self, state: dict) -> None:
        """Keep a snapshot (cloned tensors: the optimizer's own are reused by the next client)."""
        if self.cfg["train.preserve_optimizer_state"]:
            state["optimizer"] = clone_tree(self.optimizer.state_dict())
            if self.scheduler is not None:
                state["scheduler"] = clone_tree(self.scheduler.state_dict())

    def evaluate(self, client_id: int, data, received: dict) -> dict[str, float]:
        """Evaluate the received global model (with this client's local entries) on its test split."""
        state = self.store.load(client_id)
        self.load_global(received["model"], state)
        return evaluate_model(self.model, data.test.x, data.test.y, self.loss,
                              self.cfg["eval.batch_size"])


class Aggregator(Wrappable):
    """Server side: owns the global state; FedAvg's sample-weighted average by default."""

    def __init__(self, model: nn.Module, cfg, num_clients: int):
        self.cfg = cfg
        self.num_clients = num_clients
        self.shared = ShareFilter(cfg["federate.share_params"])
        self.global_state: dict[str, torch.Tensor] = {
            k: v.detach().clone() for k, v in model.state_dict().items()}
        # staleness -> weight factor; set by asynchronous courses (None: every update counts fully)
        self.discount: Callable[[int], float] | None = None
        self.uniform = cfg["aggregator.weighting"] == "uniform"
        if self.uniform and type(self).weights is not Aggregator.weights:
            raise ConfigError(f"aggregator.weighting: uniform: the {type(self).__name__} aggregation "
                              "weighs updates by a rule of its own (see its algorithm.* keys); "
                              "leave aggregator.weighting at auto or num_samples")

    def set_shared(self, shared) -> None:
        """Change which entries are exchanged (a `ShareFilter`-like callable) before any round."""
        self.shared = shared
        self.shared_changed()

    def shared_changed(self) -> None:
        """Hook: `self.shared` changed; drop server state kept for entries no longer exchanged."""

    def broadcast(self, round_: int) -> dict[str, Any]:
        """The content sent to sampled clients (by reference: never mutated afterwards)."""
        return {"model": {k: v for k, v in self.global_state.items() if self.shared(k)}}

    def evaluation_content(self, round_: int) -> dict[str, Any]:
        """What an evaluation request carries: the model only, not auxiliary training state."""
        return {"model": self.broadcast(round_)["model"]}

    def weights(self, updates: list[ReceivedUpdate]) -> list[float]:
        """Sample counts (1 each with `aggregator.weighting: uniform`), down-weighted by
        `discount(staleness)` when a course sets one."""
        counts = [1.0] * len(updates) if self.uniform else [float(u.content["num_samples"]) for u in updates]
        if self.discount is None:
            return counts
        return [w * self.discount(u.staleness) for w, u in zip(counts, updates)]

    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict[str, float]:
        """Replace the global state from `updates`; return metrics for the round's record."""
        weights = self.weights(updates)
        if sum(weights) <= 0:
            weights = [1.0] * len(updates)
        new_state = dict(self.global_state)
        if len(updates) == 1 and updates[0].owned:   # the mean of one update is itself
            new_state.update(updates[0].content["model"])
        else:
            for name in updates[0].content["model"]:
                new_state[name] = weighted_mean([u.content["model"][name] for u in updates], weights)
        self.global_state = new_state
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Server-owned algorithm state beyond the model (for checkpoints)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (when resuming from a checkpoint)."""
        if state:  # an aggregator with state must restore it: never resume with it silently reset
            raise NotImplementedError(f"{type(self).__name__} keeps server state but cannot restore it")


def _batch(split, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `idx` of a split: `index_select`, the same rows as `x[idx]` at half the cost of
    advanced indexing (which a small model's step would notice: ~6 of ~360 us on a logistic
    regression's)."""
    x, y = split.x, split.y
    if idx.device != x.device:   # data kept on a GPU, batch order drawn on the CPU
        idx = idx.to(x.device)
    return x.index_select(0, idx), y.index_select(0, idx)
