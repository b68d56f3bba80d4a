"""SCAFFOLD (Karimireddy et al., ICML 2020), Algorithm 1 with option II control variates.

Server state: the model x and the control variate c. Client i keeps c_i (zero
until its first round) in the state store. Each local step corrects the
gradient, y_i <- y_i - eta (g_i(y_i) + c - c_i); after K steps
c_i+ = c_i - c + (x - y_i) / (K eta), and the client sends dy_i = y_i - x and
dc_i = c_i+ - c_i. The server applies
    x <- x + eta_g * mean_S(dy_i)        (uniform, or sample-weighted)
    c <- c + (1/N) * sum_S(dc_i)
Broadcast and update each carry two model-sized tensors sets, and the byte
counts show it. Control variates cover shared trainable parameters; buffers
(e.g. batch-norm statistics) travel as plain deltas.

A simulation that spills (algorithms/spill.py) keeps c, each client's c_i and c - c_i
while it trains, and the update's dy_i and dc_i, in unlinked files, computed and read a
slice at a time with the same element-wise operations: the results are bit for bit those
held in memory, and the process holds the working copy and its gradients, or it and the
new c_i, not six models.
"""
from __future__ import annotations

import logging

import torch

from fedcore.algorithms.scaffold_spill import add_correction, apply_in_place, spill_begin, spilled_payload
from fedcore.kernel.contract import Aggregator, Algorithm, ReceivedUpdate, Trainer, weighted_mean
from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import algorithms
from fedcore.kernel.vector_term import VectorTerm, stack_state
from fedcore.wire.spooled import blank, park

__all__ = ["ScaffoldTrainer", "ScaffoldTerm", "ScaffoldAggregator", "SCAFFOLD"]

declare("algorithm.scaffold.global_lr", float, 1.0, "scaffold: server learning rate eta_g",
        check=positive)
declare("algorithm.scaffold.weighting", str, "uniform",
        "scaffold: how client deltas dy_i are averaged: uniform (the paper) or num_samples",
        choices=("uniform", "num_samples"))
declare("algorithm.scaffold.allow_async", bool, False,
        "scaffold: allow asynchronous aggregation (the paper's analysis is synchronous)")

log = logging.getLogger("fedcore.algorithms.scaffold")


@validator
def _check_scaffold(cfg) -> None:
    if cfg["algorithm.name"] != "scaffold":
        return
    if cfg.get("asyn.use", False) and not cfg["algorithm.scaffold.allow_async"]:
        raise ConfigError("asyn.use: scaffold is synchronous (stale control variates break its "
                          "correction); set asyn.use=false or algorithm.scaffold.allow_async=true")


def _plain_sgd(cfg) -> bool:
    o = cfg.section("train.optimizer")
    return o["type"] == "sgd" and o["momentum"] == 0 and o["weight_decay"] == 0


class ScaffoldTrainer(Trainer):
    """Local SGD with the drift correction c - c_i; sends (dy_i, dc_i)."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.lr = cfg["train.optimizer.lr"]
        self.shared_changed()
        self._correction: list[torch.Tensor] = []
        self.spill_folder: str | None = None   # set by `spill_into`
        self._spill = False
        self._spilled: dict[str, dict[str, torch.Tensor]] = {}   # "corr", "c_i" -> files' views
        if not _plain_sgd(cfg):
            log.warning("scaffold: train.optimizer is not plain SGD (type sgd, momentum 0, "
                        "weight_decay 0); c_i+ = c_i - c + (x - y_i)/(K eta) then no longer "
                        "estimates the client gradient as in the paper")

    def shared_changed(self) -> None:
        self.names = [n for n in self.param_names if self.shared(n)]
        self._corrected = [self.entries[n] for n in self.names]

    def spill_into(self, folder: str | None) -> None:
        """A spilling simulation (algorithms/spill.py): c_i, c - c_i and the update in unlinked
        files in `folder` (the system's temporary folder if None), each client's in its own."""
        self.spill_folder = folder
        self._spill = True

    @property
    def spills(self) -> bool:
        """Whether c_i and c - c_i are kept in files (`spill_into`): a batch of clients trained
        together (executor vectorized) would stack them in memory, so it trains them one by one."""
        return self._spill

    @torch.no_grad()
    def begin(self, client_state: dict, received: dict) -> None:
        c = received["control"]
        c_i = client_state.get("c_i")
        self._lr_sum = 0.0
        self._spilled = {}
        if getattr(self, "_spill", False) and spill_begin(self, client_state, c, c_i):
            return
        # c - c_i, fixed for the whole round
        self._correction = [c[n].clone() if c_i is None else c[n] - c_i[n] for n in self.names]

    @torch.no_grad()
    def adjust_gradients(self) -> None:
        # once per optimizer step: the step sizes actually used (an LR schedule changes them)
        self._lr_sum += self.optimizer.param_groups[0]["lr"]
        spilled = self._spilled.get("corr")
        for i, p in enumerate(self._corrected):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if spilled is None or not p.grad.is_contiguous():
                p.grad.add_(self._correction[i] if spilled is None else spilled[self.names[i]])
                continue
            add_correction(p.grad, spilled[self.names[i]])

    @torch.no_grad()
    def payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict:
        if self._spilled:
            out = spilled_payload(self, client_state, received, steps, n_train)
            if out is not None:
                return out
        x = received["model"]
        c = received["control"]
        c_i = client_state.get("c_i") or {n: torch.zeros_like(c[n]) for n in self.names}
        y = self.shared_state()
        delta_model = {k: y[k] - x[k] for k in y}
        delta_control, new_c_i = {}, {}
        for n in self.names:
            if steps > 0:
                # (x - y)/(K eta) with constant eta; the sum of the step sizes taken in general
                new = c_i[n] - c[n] + (x[n] - y[n]) / self._lr_sum
            else:  # no local data: nothing learnt, keep c_i
                new = c_i[n].clone()
            delta_control[n] = new - c_i[n]
            new_c_i[n] = new
        client_state["c_i"] = new_c_i
        self._correction = []   # c - c_i: a model, not kept while the update is folded and sent
        return {"delta": delta_model, "delta_control": delta_control, "num_samples": n_train}


    def vector_term(self) -> VectorTerm:
        return ScaffoldTerm(self)


class ScaffoldTerm(VectorTerm):
    """SCAFFOLD for a stack of clients: + (c - c_i); sends (y - x, c_i+ - c_i), keeps c_i+."""

    def names(self):
        return list(self.trainer.names)

    def prepare(self, received, states):
        c = received["control"]
        names = self.trainer.names
        c_i = stack_state(states, "c_i", names, c)
        fresh = torch.tensor([st.get("c_i") is None for st in states], device=self.trainer.device)
        corr = {}
        for n in names:
            # c - c_i; a client without c_i uses c itself, as `begin` does
            corr[n] = torch.where(fresh.reshape((-1,) + (1,) * c[n].dim()), c[n], c[n] - c_i[n])
        return corr, c_i

    def adjust(self, ctx, name, grad, param):
        return grad + ctx[0][name]

    def finish(self, ctx, received, params, steps, states, sizes):
        x, c = received["model"], received["control"]
        _, c_i = ctx
        lr = self.trainer.lr
        delta = {n: params[n] - x[n] for n in params}
        dc, new_c = {}, {}
        for n in self.trainer.names:
            if steps > 0:
                new = c_i[n] - c[n] + (x[n] - params[n]) / (steps * lr)
            else:
                new = c_i[n].clone()
            dc[n] = new - c_i[n]
            new_c[n] = new
        rows = {k: {n: t.unbind(0) for n, t in d.items()} for k, d in
                (("delta", delta), ("dc", dc), ("c", new_c))}
        out = []
        for j, (st, size) in enumerate(zip(states, sizes)):
            new_state = dict(st)
            new_state["c_i"] = {n: r[j].clone() for n, r in rows["c"].items()}   # its own storage
            content = {"delta": {n: r[j] for n, r in rows["delta"].items()},
                       "delta_control": {n: r[j] for n, r in rows["dc"].items()},
                       "num_samples": size}
            out.append((content, new_state))
        return out


class ScaffoldAggregator(Aggregator):
    """x <- x + eta_g mean(dy_i); c <- c + (1/N) sum(dc_i).

    Both are linear in the updates, so a round may fold them as they arrive
    (algorithms/streaming.py): the weighted mean of dy_i and the sum of dc_i, which arrive as
    one update whose mean and sum are themselves."""

    streams_updates = True
    folded = {"delta": False, "delta_control": True}
    replaces_state = True   # c is replaced, never written in place (runtime/admission.py Snapshot)

    def __init__(self, model, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        self.global_lr = cfg["algorithm.scaffold.global_lr"]
        self.weighting = cfg["algorithm.scaffold.weighting"]
        names = [n for n, p in model.named_parameters() if p.requires_grad and self.shared(n)]
        self._control_names = names
        self._control: dict[str, torch.Tensor] | None = None   # zeros, made when first needed
        # eta_g scales the parameters' step; buffers (BatchNorm statistics, counters) are no step
        # to scale: they take the plain mean delta (eta_g > 1 could make a variance negative)
        self.parameter_names = {n for n, _ in model.named_parameters()}
        self._park_control: tuple[str | None] | None = None   # `spill_into`'s folder, until used

    @property
    def control(self) -> dict[str, torch.Tensor]:
        """c; zeros until the first round, made only when first read (a spilling simulation's
        in a sparse file: `spill_into`), not while the course is built beside its models."""
        if self._control is None:
            self._control = {n: torch.zeros_like(self.global_state[n]) for n in self._control_names}
        return self._control

    @control.setter
    def control(self, value: dict[str, torch.Tensor]) -> None:
        self._control = value

    def shared_changed(self) -> None:
        if self._control is None:
            self._control_names = [n for n in self._control_names if self.shared(n)]
        else:
            self.control = {n: c for n, c in self.control.items() if self.shared(n)}

    def broadcast(self, round_: int) -> dict:
        if self._park_control is not None:
            self._parked_control()
        content = super().broadcast(round_)
        content["control"] = dict(self.control)
        return content

    def weights(self, updates: list[ReceivedUpdate]) -> list[float]:
        if self.weighting == "uniform":
            return [1.0] * len(updates)
        return super().weights(updates)

    def spill_into(self, folder: str | None) -> None:
        """A spilling simulation (algorithms/spill.py): c is copied into an unlinked file in
        `folder` as the next round starts (`broadcast`); from then on each round's c is written
        into the file of its summed dc_i (`_adopt`)."""
        self._park_control = (folder,)

    def _parked_control(self) -> None:
        folder, = self._park_control
        self._park_control = None
        try:
            if self._control is None:   # zeros: a sparse file, nothing written
                like = {n: self.global_state[n] for n in self._control_names}
                self.control = blank({n: (tuple(t.shape), t.dtype) for n, t in like.items()}, folder)
            else:
                self.control = park(dict(self.control), folder)
        except OSError as exc:
            log.warning("aggregator.spill: SCAFFOLD's control variate could not be kept in a file in %s "
                        "(%s); it stays in memory", folder or "the temporary folder", exc)

    @torch.no_grad()
    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict:
        if len(updates) == 1 and updates[0].owned:
            return self._adopt(updates[0].content)
        weights = self.weights(updates)
        if sum(weights) <= 0:
            weights = [1.0] * len(updates)
        new_state = dict(self.global_state)
        for name in updates[0].content["delta"]:
            mean = weighted_mean([u.content["delta"][name] for u in updates], weights)
            x = self.global_state[name]
            if name in self.parameter_names:
                new_state[name] = x + self.global_lr * mean
            else:  # buffers, floating (running statistics) or integer (batch counters)
                new_state[name] = x + mean
        new_control = {}
        for name, c in self.control.items():
            total = torch.stack([u.content["delta_control"][name] for u in updates]).sum(0)
            new_control[name] = c + total / self.num_clients
        self.global_state, self.control = new_state, new_control
        return {}

    def _adopt(self, content: dict) -> dict:
        """A folding round's one update (its mean dy_i, its summed dc_i, made for this
        aggregation alone): x + eta_g mean and c + sum / N written into its own tensors, a slice
        at a time, pages given back where they lie in files. The mean of one update is itself
        and the sum of one is itself, and the remaining operations are those of the list's
        course on the same values: bit for bit its result."""
        new_state = dict(self.global_state)
        for name, mean in content["delta"].items():
            scale = self.global_lr if name in self.parameter_names else None
            new_state[name] = apply_in_place(mean, self.global_state[name], scale, None)
        new_control = {name: apply_in_place(content["delta_control"][name], c, None, self.num_clients)
                       for name, c in self.control.items()}
        self.global_state, self.control = new_state, new_control
        return {}

    def state_dict(self) -> dict:
        return {"control": dict(self.control)}

    def load_state_dict(self, state: dict) -> None:
        self.control = dict(state["control"])




def update_layout(server) -> dict:
    """What a deployed server accepts from a client: dy_i over the model, dc_i over c."""
    agg = server.aggregator
    return {"delta": agg.broadcast(server.round)["model"], "delta_control": agg.control}


SCAFFOLD = algorithms.register("scaffold", Algorithm(ScaffoldTrainer, ScaffoldAggregator,
                                                     update_layout=update_layout))
