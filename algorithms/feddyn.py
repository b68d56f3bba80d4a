"""FedDyn (Acar et al., ICLR 2021), Algorithm 1: dynamic regularisation.

Client k keeps g_k (zero at first; stored per logical client) and minimises
    L_k(theta) - <g_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2,
i.e. each step uses grad L_k(theta) - g_k + alpha (theta - theta^{t-1}); after
training g_k <- g_k - alpha (theta_k - theta^{t-1}) and theta_k is sent.
The server keeps h (zero at first):
    h       <- h - alpha (1/N) sum_{k in S} (theta_k - theta^{t-1})
    theta^t  = (1/|S|) sum_{k in S} theta_k - h / alpha
Only shared trainable parameters are regularised; buffers are averaged.
"""
from __future__ import annotations

from typing import Iterable

import torch

from fedcore.kernel.contract import Aggregator, Algorithm, ReceivedUpdate, Trainer, weighted_mean
from fedcore.kernel.config import declare, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import algorithms
from fedcore.kernel.vector_term import VectorTerm, stack_state
from fedcore.wire.spooled import release

__all__ = ["FedDynTrainer", "FedDynTerm", "FedDynAggregator", "FEDDYN"]

declare("algorithm.feddyn.alpha", float, 0.01, "feddyn: regularisation coefficient alpha (> 0; "
        "the server divides by it)", check=lambda v: None if v > 0 else "must be > 0 (theta^t "
        "subtracts h/alpha); use algorithm.name=fedavg for no regulariser")


@validator
def _check_feddyn(cfg) -> None:
    # The server's h and theta^t use theta_k - theta^{t-1} of the round every client started
    # from; a stale theta_k would be taken against a newer model (and uniform weights ignore
    # the staleness discount), so asynchronous aggregation is not FedDyn.
    if cfg["algorithm.name"] == "feddyn" and cfg.get("asyn.use", False):
        raise ConfigError("asyn.use: algorithm feddyn is synchronous (its server state h needs each "
                          "model's drift from the round it started from); set asyn.use=false")


class FedDynTrainer(Trainer):
    """Local training on the dynamically regularised objective; updates g_k."""

    def __init__(self, model, cfg, store):
        super().__init__(model, cfg, store)
        self.alpha = cfg["algorithm.feddyn.alpha"]
        self.shared_changed()
        self._anchor: list[torch.Tensor] = []
        self._g: list[torch.Tensor | None] = []

    def shared_changed(self) -> None:
        self.names = [n for n in self.param_names if self.shared(n)]
        self._params = [self.entries[n] for n in self.names]

    def begin(self, client_state: dict, received: dict) -> None:
        self._anchor = [received["model"][n] for n in self.names]   # theta^{t-1}, read only
        g = client_state.get("g")
        # None: g_k = 0 (a client's first round), without a model of zeros: x - 0 is x and
        # 0.0 - x is 0 - x, bit for bit
        self._g = [None if g is None else g[n] for n in self.names]

    @torch.no_grad()
    def adjust_gradients(self) -> None:
        for p, g_k, anchor in zip(self._params, self._g, self._anchor):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if g_k is not None:
                p.grad.sub_(g_k)
            p.grad.add_(p - anchor, alpha=self.alpha)

    @torch.no_grad()
    def payload(self, client_state: dict, received: dict, steps: int, n_train: int) -> dict:
        new_g = {}
        for n, p, g_k, anchor in zip(self.names, self._params, self._g, self._anchor):
            out = new_g[n] = torch.empty(p.shape, dtype=p.dtype if g_k is None else torch.result_type(g_k, p),
                                         device=p.device)
            for a, b, flat_out, (flat_g, flat_p, flat_anchor) in _slices(out, g_k, p, anchor):
                g_part = 0.0 if flat_g is None else flat_g[a:b]
                flat_out[a:b] = g_part - self.alpha * (flat_p[a:b] - flat_anchor[a:b])
                release(flat_anchor[a:b])   # a parked global model's pages go back once read
        client_state["g"] = new_g
        return super().payload(client_state, received, steps, n_train)

    def vector_term(self) -> VectorTerm:
        return FedDynTerm(self)


class FedDynTerm(VectorTerm):
    """FedDyn for a stack of clients: - g_k + alpha (theta - theta^{t-1}); keeps
    g_k - alpha (theta_k - theta^{t-1})."""

    def names(self):
        return list(self.trainer.names)

    def prepare(self, received, states):
        anchor = received["model"]
        return self.trainer.alpha, anchor, stack_state(states, "g", self.trainer.names, anchor)

    def adjust(self, ctx, name, grad, param):
        alpha, anchor, g = ctx
        return grad.sub(g[name]).add(param - anchor[name], alpha=alpha)

    def finish(self, ctx, received, params, steps, states, sizes):
        alpha, anchor, g = ctx
        new_g = {n: g[n] - alpha * (params[n] - anchor[n]) for n in self.trainer.names}
        rows = {n: t.unbind(0) for n, t in new_g.items()}
        out = super().finish(ctx, received, params, steps, states, sizes)
        for j, (_, new_state) in enumerate(out):
            new_state["g"] = {n: r[j].clone() for n, r in rows.items()}
        return out


class FedDynAggregator(Aggregator):
    """theta^t = mean_S(theta_k) - h/alpha with h the running (1/N)-scaled drift.

    The drift sum_S(theta_k - theta^{t-1}) is |S| (mean_S(theta_k) - theta^{t-1}), so a round
    may fold its models as they arrive (algorithms/streaming.py): the uniform mean, with |S|
    the round's contributors; equal to the list's course to float32 rounding."""

    streams_updates = True

    def __init__(self, model, cfg, num_clients: int):
        super().__init__(model, cfg, num_clients)
        self.alpha = cfg["algorithm.feddyn.alpha"]
        names = [n for n, p in model.named_parameters() if p.requires_grad and self.shared(n)]
        self.h: dict[str, torch.Tensor] = {n: torch.zeros_like(self.global_state[n]) for n in names}

    def shared_changed(self) -> None:
        self.h = {n: h for n, h in self.h.items() if self.shared(n)}

    def weights(self, updates: list[ReceivedUpdate]) -> list[float]:
        return [1.0] * len(updates)   # Algorithm 1 averages the active clients uniformly

    @torch.no_grad()
    def aggregate(self, updates: list[ReceivedUpdate], round_: int) -> dict:
        if len(updates) == 1 and updates[0].owned:   # a folding round's mean of its models
            return self._folded(updates[0])
        weights = self.weights(updates)

        def entries():
            for name in updates[0].content["model"]:
                models = [u.content["model"][name] for u in updates]
                drift = (torch.stack([m - self.global_state[name] for m in models]).sum(0)
                         if name in self.h else None)
                yield name, weighted_mean(models, weights), drift
        return self._step(entries())

    def _folded(self, update: ReceivedUpdate) -> dict:
        count = len(getattr(update, "contributors", None) or [update.client_id])
        return self._step((name, mean, count if name in self.h else None)
                          for name, mean in update.content["model"].items())

    def _step(self, entries: Iterable[tuple[str, torch.Tensor, torch.Tensor | int | None]]) -> dict:
        """Algorithm 1's server step from each entry's mean and the summed drift Σ(θ_i − θ) of
        the round's clients, or the number |S| of a folded round's clients whose drift is
        |S|(mean − θ) (None for an entry without h). Taken an entry at a time and a slice at a
        time, the new model written over the round's own mean: the same element-wise
        operations on the same values (the same bits), without model-sized temporaries."""
        new_state, new_h = dict(self.global_state), dict(self.h)
        for name, mean, drift in entries:
            if drift is not None:
                mean = mean if mean.is_contiguous() else mean.contiguous()
                out = new_h[name] = torch.empty_like(self.h[name], memory_format=torch.contiguous_format)
                summed = drift if isinstance(drift, torch.Tensor) else None
                for a, b, flat_out, (flat_h, flat_mean, flat_x, flat_drift) in _slices(
                        out, self.h[name], mean, self.global_state[name], summed):
                    d = flat_drift[a:b] if summed is not None else (flat_mean[a:b] - flat_x[a:b]) * drift
                    flat_out[a:b] = flat_h[a:b] - self.alpha * d / self.num_clients
                    flat_mean[a:b] = flat_mean[a:b] - flat_out[a:b] / self.alpha
                    release(flat_x[a:b])      # a parked global model's pages go back once read
                    release(flat_mean[a:b])   # and a spilled mean's once written
            new_state[name] = mean
        self.global_state, self.h = new_state, new_h
        return {}

    def state_dict(self) -> dict:
        return {"h": dict(self.h)}

    def load_state_dict(self, state: dict) -> None:
        self.h = dict(state["h"])


SLICE = 2 ** 20   # elements of one slice of FedDyn's element-wise state updates


def _slices(out: torch.Tensor, *ins: torch.Tensor | None):
    """(start, stop, out's flat view, the inputs' flat views) for each slice of SLICE elements:
    element-wise arithmetic taken a slice at a time gives the very bits of the whole-tensor
    operation, with slice-sized temporaries instead of model-sized ones."""
    flat_out = out.view(-1)
    flats = tuple(None if t is None else t.reshape(-1) for t in ins)
    for a in range(0, flat_out.numel(), SLICE):
        yield a, min(a + SLICE, flat_out.numel()), flat_out, flats


FEDDYN = algorithms.register("feddyn", Algorithm(FedDynTrainer, FedDynAggregator))
