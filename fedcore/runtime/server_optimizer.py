"""Server optimizers (FedOpt): a step on the pseudo-gradient of whatever the aggregator produced.

With x the global model before an aggregation and y the aggregate (FedAvg's
weighted mean, a robust rule's combination, FedBuff's buffered step, the
unmasked sum of secure aggregation, ...), the pseudo-gradient is Δ = y - x
and the server sets x <- x + u(Δ):

    sgd       u = η Δ                                  (η = 1: x <- y, today's behaviour)
    sgdm      m = β m + Δ;             u = η m          (FedAvgM, Hsu et al. 2019)
    nesterov  m = β m + Δ;             u = η (Δ + β m)  (PyTorch's Nesterov, DiLoCo's outer step)
    adagrad   m = β1 m + (1-β1) Δ;  v = v + Δ²                          u = η m / (√v + τ)
    adam      m = β1 m + (1-β1) Δ;  v = β2 v + (1-β2) Δ²                u = η m / (√v + τ)
    yogi      m = β1 m + (1-β1) Δ;  v = v - (1-β2) Δ² sign(v - Δ²)      u = η m / (√v + τ)

The last three are Algorithm 2 of Reddi et al. (ICLR 2021) with m_{-1} = 0 and
v_{-1} = τ² (the least value the algorithm allows); there is no bias correction
unless `server_optimizer.bias_correction` asks for Adam's (m / (1 - β1^t), and
v / (1 - β2^t) for adam and yogi). The optimizer acts on the shared trainable
floating parameters; buffers and integer entries take the aggregate as it is.
Its state (m, v, t) is saved with every checkpoint. The alignment note is
docs/algorithms/server_optimizers.md.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from fedcore.kernel.config import declare, lives_elsewhere, positive, validator
from fedcore.kernel.hooks import Wrapper
from fedcore.kernel.errors import ConfigError
from fedcore.wire.spooled import release

__all__ = ["ServerOptimizer", "KINDS", "from_config", "install", "l2_norm", "optimized_names"]

KINDS = ("sgd", "sgdm", "nesterov", "adagrad", "adam", "yogi")
ADAPTIVE = ("adagrad", "adam", "yogi")

declare("server_optimizer.type", str, "sgd",
        "server optimizer on the pseudo-gradient (aggregate - global model): sgd (lr 1 = plain "
        "aggregation), sgdm (FedAvgM), nesterov, adagrad, adam, yogi (Reddi et al. 2021)",
        choices=KINDS)
declare("server_optimizer.lr", float, None,
        "server learning rate eta (default 1 for sgd, sgdm and nesterov, 0.01 for adagrad, adam "
        "and yogi)", check=positive)
declare("server_optimizer.momentum", float, 0.9, "sgdm, nesterov: server momentum beta",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("server_optimizer.beta1", float, 0.9, "adagrad, adam, yogi: first-moment decay beta1",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("server_optimizer.beta2", float, 0.99, "adam, yogi: second-moment decay beta2",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("server_optimizer.tau", float, 1e-3, "adagrad, adam, yogi: adaptivity tau (also "
        "v_{-1} = tau^2)", check=positive)
declare("server_optimizer.bias_correction", bool, False,
        "adagrad, adam, yogi: divide m by 1 - beta1^t (and v by 1 - beta2^t for adam, yogi) as "
        "Adam does; Reddi et al.'s Algorithm 2 has none")
for _name, _kind in (("fedavgm", "sgdm"), ("fedadagrad", "adagrad"), ("fedadam", "adam"), ("fedyogi", "yogi")):
    lives_elsewhere("algorithm.name", _name, f"server_optimizer.type={_kind} (on the aggregate of any algorithm.name)")

# algorithm -> why a server optimizer cannot follow its aggregation
REFUSED = {
    "feddyn": "its server model mean - h/alpha is its own rule; a moment estimate would "
              "accumulate the h/alpha correction as if it were progress",
    "diloco": "its outer optimizer is algorithm.diloco.outer_optimizer (the same mechanism)",
}


def _default_lr(kind: str) -> float:
    return 0.01 if kind in ADAPTIVE else 1.0


@validator
def _check_server_optimizer(cfg) -> None:
    kind, lr = cfg["server_optimizer.type"], cfg["server_optimizer.lr"]
    if kind == "sgd" and (lr is None or lr == 1):
        return
    why = REFUSED.get(cfg["algorithm.name"])
    if why:
        raise ConfigError(f"server_optimizer.type: algorithm {cfg['algorithm.name']} takes no server "
                          f"optimizer ({why}); leave server_optimizer.type=sgd with lr 1")
    if cfg["algorithm.name"] == "fedbuff" and cfg["algorithm.fedbuff.server_lr"] != 1:
        raise ConfigError("algorithm.fedbuff.server_lr: FedBuff's server learning rate and "
                          "server_optimizer.lr are the same step size; set only server_optimizer.lr")
    if cfg["algorithm.name"] == "fedmos" and cfg["algorithm.fedmos.server_momentum"] > 0:
        raise ConfigError("algorithm.fedmos.server_momentum: FedMoS's server momentum is a server "
                          "optimizer already; set it to 0 to use server_optimizer.type")


class ServerOptimizer:
    """x <- x + u(Δ) entry by entry, with the moments of each entry as server state."""

    def __init__(self, kind: str, lr: float, momentum: float = 0.9, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3, bias_correction: bool = False):
        if kind not in KINDS:
            raise ValueError(f"unknown server optimizer '{kind}' ({', '.join(KINDS)})")
        self.kind, self.lr, self.momentum = kind, lr, momentum
        self.beta1, self.beta2, self.tau = beta1, beta2, tau
        self.bias_correction = bias_correction
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.t = 0          # steps taken
        # where a banded step writes the new model and moments: memory, or a file (a simulation
        # that spills them, algorithms/spill.py `spill_in_simulation`)
        self.allocate: Callable[[torch.Tensor], torch.Tensor] = torch.empty_like

    @property
    def identity(self) -> bool:
        """sgd with η = 1: x + Δ is the aggregate itself, taken as it is (no rounding)."""
        return self.kind == "sgd" and self.lr == 1

    @torch.no_grad()
    def updates(self, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """u(Δ) for each entry of `deltas` (new tensors); advances the moments by one step."""
        self.t += 1
        return {name: self._update(name, d) for name, d in deltas.items()}

    def _update(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        step, m, v = self._moments(delta, self.m.get(name), self.v.get(name))
        if m is not None:
            self.m[name] = m
        if v is not None:
            self.v[name] = v
        return step

    def _moments(self, delta: torch.Tensor, m: torch.Tensor | None,
                 v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(u, m', v') for `delta`, a whole entry or a band of one, from the moments before
        (None at the first step); `m` and `v` are read, never written."""
        kind, lr = self.kind, self.lr
        if kind == "sgd":
            return lr * delta, None, None
        if kind in ("sgdm", "nesterov"):
            m = delta if m is None else self.momentum * m + delta
            return (lr * (delta + self.momentum * m) if kind == "nesterov" else lr * m), m, None
        # b1 m + (1 - b1) d and the rest, with the temporaries reused in place: the very same
        # operations (products commute exactly), a few models fewer alive at once
        b1, b2 = self.beta1, self.beta2
        m = (torch.zeros_like(delta) if m is None else m) * b1
        m.add_(delta * (1 - b1))
        if v is None:
            v = torch.full_like(delta, self.tau ** 2)
        sq = delta * delta
        if kind == "adagrad":
            v = sq.add_(v)
        elif kind == "adam":
            v = (v * b2).add_(sq.mul_(1 - b2))
        else:  # yogi: v - (1 - b2) sq sign(v - sq)
            sign = (v - sq).sign_()
            v = v - sq.mul_(1 - b2).mul_(sign)
            del sign
        del sq
        moments = m, v
        if self.bias_correction:
            m = m / (1 - b1 ** self.t)
            root = (v / (1 - b2 ** self.t)).sqrt_() if kind != "adagrad" else v.sqrt()
        else:
            root = v.sqrt()
        return (m * lr).div_(root.add_(self.tau)), *moments

    def apply(self, x: dict[str, torch.Tensor], aggregate: dict[str, torch.Tensor],
              names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The next global state: `aggregate`, with x + u(aggregate - x) for `names`; and the
        step's norms for the round's record."""
        new = dict(aggregate)
        if self.identity:
            return new, {}
        # entry by entry: one entry's pseudo-gradient and step alive at a time, not the whole
        # model's (the same operations, and the norms' squares summed in the same order)
        self.t += 1
        deltas_sq = steps_sq = 0.0
        with torch.no_grad():
            for n in (n for n in names if n in aggregate):
                if _banded(aggregate[n], x[n], self.m.get(n), self.v.get(n)):
                    new[n], squares = self._apply_banded(n, x[n], aggregate[n])
                    deltas_sq += squares[0]
                    steps_sq += squares[1]
                    continue
                delta = aggregate[n] - x[n]
                deltas_sq += _square_sum(delta)
                step = self._update(n, delta)
                del delta
                steps_sq += _square_sum(step)
                new[n] = x[n] + step
        return new, {"server_pseudo_grad_norm": math.sqrt(deltas_sq),
                     "server_update_norm": math.sqrt(steps_sq)}

    def _apply_banded(self, name: str, x: torch.Tensor,
                      aggregate: torch.Tensor) -> tuple[torch.Tensor, tuple[float, float]]:
        """x + u(aggregate - x) for one large entry, BAND values at a time: the new moments and
        the result are written band by band into tensors of their own (the old moments stay
        as they are for a snapshot that may restore them), so the pseudo-gradient, the step
        and their temporaries take a band each, not a model each. Each value goes through the
        same operations as in `_update`; the norms' squares are summed band by band."""
        adaptive, momentum = self.kind in ADAPTIVE, self.kind != "sgd"
        old_m, old_v = self.m.get(name), self.v.get(name)
        out = self.allocate(aggregate)
        new_m = self.allocate(aggregate) if momentum else None
        new_v = self.allocate(aggregate) if adaptive else None
        flat = lambda t: None if t is None else t.view(-1)  # noqa: E731
        xs, ys, outs, ms, vs, new_ms, new_vs = map(flat, (x, aggregate, out, old_m, old_v, new_m, new_v))
        deltas_sq = steps_sq = 0.0
        for at in range(0, ys.numel(), BAND):
            band = slice(at, at + BAND)
            delta = ys[band] - xs[band]
            deltas_sq += _square_sum(delta)
            step, m, v = self._moments(delta, None if ms is None else ms[band], None if vs is None else vs[band])
            if m is not None:
                new_ms[band].copy_(m)
            if v is not None:
                new_vs[band].copy_(v)
            del delta, m, v
            steps_sq += _square_sum(step)
            torch.add(xs[band], step, out=outs[band])
            # a parked global model's pages go back once read (wire/spooled.py), and spilled
            # moments' and results' once read or written
            for t in (xs, ys, outs, ms, vs, new_ms, new_vs):
                if t is not None:
                    release(t[band])
        if momentum:
            self.m[name] = new_m
        if adaptive:
            self.v[name] = new_v
        return out, (deltas_sq, steps_sq)

    def snapshot(self) -> dict[str, Any]:
        """The state as `load_state_dict` takes it, holding the moments themselves, not copies
        (two models less in an aggregation that may be rejected): a step replaces each moment
        with a new tensor and never writes one in place."""
        return {"m": dict(self.m), "v": dict(self.v), "t": self.t}

    def state_dict(self) -> dict[str, Any]:
        return {"m": {k: v.clone() for k, v in self.m.items()},
                "v": {k: v.clone() for k, v in self.v.items()}, "t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = {k: v.clone() for k, v in state.get("m", {}).items()}
        self.v = {k: v.clone() for k, v in state.get("v", {}).items()}
        self.t = int(state.get("t", 0))


BAND = 2 ** 20   # values of a large entry stepped at a time (a float32 band's temporaries: ~4 MiB each)


def _banded(aggregate: torch.Tensor, x: torch.Tensor, *moments: torch.Tensor | None) -> bool:
    """Whether an entry is stepped a band at a time: more than one band of values, the
    tensors (and the moments so far) contiguous and alike (smaller entries keep the
    whole-tensor step, and their norms stay the same sums bit for bit)."""
    alike = [t for t in (x, *moments) if t is not None]
    return (aggregate.numel() > BAND and aggregate.is_contiguous()
            and all(t.is_contiguous() and t.shape == aggregate.shape and t.dtype == aggregate.dtype
                    and t.device == aggregate.device for t in alike))


def l2_norm(tensors) -> float:
    return math.sqrt(sum(_square_sum(t) for t in tensors))


def _square_sum(t: torch.Tensor) -> float:
    """sum(t^2) in float64, squaring the float64 copy in place (never `t` itself)."""
    d = t.double()
    return float((d.square() if d is t else d.square_()).sum())


def from_config(cfg) -> ServerOptimizer:
    """The optimizer the `server_optimizer.*` keys describe."""
    o = cfg.section("server_optimizer")
    kind = o["type"]
    lr = o["lr"] if o["lr"] is not None else _default_lr(kind)
    return ServerOptimizer(kind, lr, o["momentum"], o["beta1"], o["beta2"], o["tau"],
                           o["bias_correction"])


def optimized_names(model: torch.nn.Module, shared) -> list[str]:
    """The entries a server optimizer moves: shared, trainable, floating parameters."""
    return [n for n, p in model.named_parameters()
            if p.requires_grad and p.is_floating_point() and shared(n)]


def install(server, checkpointer) -> ServerOptimizer | None:
    """Make the configured optimizer follow every aggregation of `server.aggregator` (None when
    it is the identity). It wraps `aggregate`, so whatever replaces or wraps the combination
    (robust rules, central DP, secure aggregation) produces the aggregate it steps from."""
    opt = from_config(server.course.cfg)
    if opt.identity:
        return None
    aggregator = server.aggregator

    def aggregate(inner, updates, round_):
        before = aggregator.global_state
        out = dict(inner(updates, round_) or {})
        names = optimized_names(server.model, aggregator.shared)
        aggregator.global_state, norms = opt.apply(before, aggregator.global_state, names)
        out.update(norms)
        return out

    aggregator.wrap(Wrapper("server optimizer", "aggregate", aggregate))
    aggregator.server_optimizer = opt
    checkpointer.register("server_optimizer", opt.state_dict, opt.load_state_dict)
    return opt
