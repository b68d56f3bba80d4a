"""Vectorised local training: many logical clients' SGD in one batched computation.

For a trainer whose local step is a pure function of (parameters, mini-batch)
- the base `Trainer`'s objective and SGD, on a model with no buffers - the
clients that received the same model are trained together: their parameters
are stacked along a new leading dimension and every step computes all their
gradients at once with `torch.func` (`functional_call`, `grad_and_value`,
`vmap`). Each client keeps its own seeded mini-batch stream; clients whose
streams give the same batch sizes step by step are grouped, so every batch
has one shape. The optimizer update is torch's SGD rule (weight decay,
momentum started fresh each round, as the sequential trainer does), written
for stacked tensors.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedcore.algorithms.base import BatchStream, FitResult, Trainer
from fedcore.batching import Engine

__all__ = ["VectorEngine"]

# Trainer methods whose base behaviour the vectorised step reproduces; a subclass that
# defines anything of its own (a hook, a helper, a constant) is not vectorised.
_STACK_BYTES = 256 * 2 ** 20   # stack a group's data when it takes at most this much memory

_PURE_HOOKS = ("fit", "step", "objective", "adjust_gradients", "begin", "payload", "load_global",
               "shared_state", "num_steps", "_restore_optimizer", "_save_optimizer", "_save_local")


class VectorEngine(Engine):
    name = "vectorized"

    def __init__(self, trainer: Trainer, cfg):
        self.cfg = cfg
        self.names = list(trainer.param_names)
        self.lr = cfg["train.optimizer.lr"]
        self.momentum = cfg["train.optimizer.momentum"]
        self.weight_decay = cfg["train.optimizer.weight_decay"]
        self.batch_size = cfg["train.batch_size"]
        self.seed = cfg["seed"]
        model, loss = trainer.model, trainer.loss

        def objective(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
            out = functional_call(model, params, (x,))
            if loss == "mse":
                return nn.functional.mse_loss(out.reshape(y.shape), y)
            return nn.functional.cross_entropy(out, y)
        self._step = vmap(grad_and_value(objective))
        self._first_step = vmap(grad_and_value(objective), in_dims=(None, 0, 0))

    @staticmethod
    def unsupported(trainer, cfg) -> str | None:
        """Why this trainer/config cannot be vectorised, or None if it can."""
        if not isinstance(trainer, Trainer):
            return f"trainer {type(trainer).__name__} is not a fedcore Trainer"
        changed = [h for h in _PURE_HOOKS if getattr(type(trainer), h) is not getattr(Trainer, h)]
        for cls in type(trainer).__mro__:   # anything a subclass defines may change the step
            if cls is Trainer:
                break
            changed += [n for n in vars(cls) if not (n.startswith("__") and n.endswith("__"))
                        and n not in changed]
        if changed:
            return (f"trainer {type(trainer).__name__} changes {', '.join(changed)}; only the base "
                    "local SGD objective is vectorised")
        if cfg["train.optimizer.type"] != "sgd":
            return f"train.optimizer.type={cfg['train.optimizer.type']} (only sgd is vectorised)"
        if cfg["train.preserve_optimizer_state"]:
            return "train.preserve_optimizer_state keeps per-client optimizer state"
        if trainer._local_init:
            return "federate.share_params keeps some entries local"
        if any(True for _ in trainer.model.buffers()):
            return "the model has buffers (per-sample state such as batch norm)"
        if len(trainer.params) != len(list(trainer.model.parameters())):
            return "the model has frozen parameters"
        return None

    # ------------------------------------------------------------ the batch
    def fit_many(self, trainer, jobs, received, round_):
        model_in = received["model"]
        if set(model_in) != set(self.names):
            return [None] * len(jobs)
        plans = []
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, (cid, data, state) in enumerate(jobs):
            train = data.train
            n = len(train)
            pos = state.get("sampler", {"epoch": 0, "offset": 0})
            stream = BatchStream(n, self.batch_size, self.seed, cid, pos["epoch"], pos["offset"])
            steps = trainer.num_steps(n) if n else 0
            idx = [stream.next() for _ in range(steps)]
            plans.append((train, idx, stream.position(), n))
            groups[(tuple(j.numel() for j in idx), tuple(train.x.shape[1:]), train.x.dtype,
                    tuple(train.y.shape[1:]), train.y.dtype)].append(i)
        out: list[Any] = [None] * len(jobs)
        trainer.model.train()
        for sig, members in groups.items():
            if len(members) < 2:
                continue   # nothing to batch with: the trainer itself is faster for one client
            params, losses = self._train_group(model_in, [plans[i] for i in members], len(sig[0]))
            work = float(sum(sig[0]))
            steps = len(sig[0])
            rows = {name: params[name].unbind(0) for name in self.names}   # views, one call each
            for j, i in enumerate(members):
                state = jobs[i][2]
                position, n = plans[i][2], plans[i][3]
                new_state = dict(state)
                new_state["sampler"] = position
                content = {"model": {name: rows[name][j] for name in self.names}, "num_samples": n}
                metrics = {"train_loss": losses[j] / steps} if steps else {}
                out[i] = (FitResult(content, work, metrics), new_state)
        return out

    @staticmethod
    def _batches(plans: list, steps: int):
        """Each step's mini-batches of all clients of a group, as [clients, batch, ...] tensors.

        When the group's data together are small they are concatenated once and every
        step is one indexing operation; otherwise each client's batch is gathered into
        place on its own.
        """
        if steps == 0:
            return
        x0 = plans[0][0].x
        if sum(p[3] for p in plans) * x0[0].numel() * x0.element_size() <= _STACK_BYTES:
            c = len(plans)
            xs = torch.cat([p[0].x for p in plans])          # all clients' samples, one after another
            ys = torch.cat([p[0].y for p in plans])
            sizes = torch.tensor([0] + [p[3] for p in plans[:-1]])
            first = sizes.cumsum(0).unsqueeze(1)             # each client's first row
            for s in range(steps):
                rows = (torch.stack([p[1][s] for p in plans]) + first).reshape(-1)
                b = rows.numel() // c
                yield (xs.index_select(0, rows).reshape((c, b) + tuple(xs.shape[1:])),
                       ys.index_select(0, rows).reshape((c, b) + tuple(ys.shape[1:])))
        else:
            for s in range(steps):
                yield VectorEngine._gather(plans, s)

    @staticmethod
    def _gather(plans: list, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `s`'s mini-batches of all clients of a group, written straight into one tensor."""
        x0, y0 = plans[0][0].x, plans[0][0].y
        b = len(plans[0][1][s])
        xb = torch.empty((len(plans), b) + tuple(x0.shape[1:]), dtype=x0.dtype)
        yb = torch.empty((len(plans), b) + tuple(y0.shape[1:]), dtype=y0.dtype)
        for j, (train, idx, _, _) in enumerate(plans):
            torch.index_select(train.x, 0, idx[s], out=xb[j])
            torch.index_select(train.y, 0, idx[s], out=yb[j])
        return xb, yb

    @torch.no_grad()
    def _train_group(self, model_in: dict[str, torch.Tensor], plans: list, steps: int):
        c = len(plans)
        # The first step starts every client from the same received tensors (not batched,
        # not copied); its update creates each client's own stacked parameters.
        params = {n: model_in[n].detach() for n in self.names}
        bufs: dict[str, torch.Tensor] = {}
        loss_sum = torch.zeros(c, dtype=torch.float64)
        for s, (xb, yb) in enumerate(self._batches(plans, steps)):
            with torch.enable_grad():
                grads, loss = (self._step if s else self._first_step)(params, xb, yb)
            loss_sum += loss.double()
            for n in self.names:
                d = grads[n]
                if self.weight_decay:
                    d = d.add(params[n], alpha=self.weight_decay)
                if self.momentum:
                    if n in bufs:
                        bufs[n].mul_(self.momentum).add_(d)
                    else:
                        bufs[n] = d.clone()
                    d = bufs[n]
                if s:
                    params[n].add_(d, alpha=-self.lr)
                else:
                    params[n] = torch.add(params[n], d, alpha=-self.lr)   # broadcasts to [c, ...]
        if steps == 0:   # clients without training data send the received model back
            params = {n: p.unsqueeze(0).repeat((c,) + (1,) * p.dim()) for n, p in params.items()}
        return params, loss_sum.tolist()
