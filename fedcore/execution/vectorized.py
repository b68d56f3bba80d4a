"""Vectorised local training: many logical clients' SGD in one batched computation.

For a trainer whose local step is a pure function of (parameters, mini-batch)
- the base `Trainer`'s objective and SGD, on a model that keeps no state in
buffers (a non-persistent buffer, such as a rotary embedding's frequencies, is
a constant; so are frozen parameters outside the model's state, such as
LoRA's base weights: every client of a group shares them unbatched) - the
clients that received the same model are trained together: their parameters
are stacked along a new leading dimension and every step computes all their
gradients at once with `torch.func` (`functional_call`, `grad_and_value`,
`vmap`). Each client keeps its own seeded mini-batch stream; clients whose
streams give the same batch sizes step by step are grouped, so every batch
has one shape. The optimizer update is torch's SGD rule (weight decay,
momentum started fresh each round, as the sequential trainer does), written
for stacked tensors.

On CPU, convolutions run per client with the dense kernels the sequential
trainer uses (`fedcore.execution.client_conv`) instead of as `vmap`'s grouped
convolutions, which are slower there; and a model made of Flatten, Linear and
ReLU layers takes its steps as the operations `vmap` would run, called
directly (`fedcore.execution.dense_step`: the same numbers, without the transforms'
overhead).

Dropout layers draw their masks from each client's own round stream, as the
sequential fit does: the engine draws them outside `vmap`, one generator per
client, and its copy of the model multiplies by them (`fedcore.execution.random_layers`).

An algorithm that adds a gradient term (a pure function of the parameters,
the received content and the client's state), sends something else than the
model or keeps per-client state says so for the whole stack in a
`fedcore.kernel.vector_term.VectorTerm`, which its trainer returns from
`Trainer.vector_term()`; this module imports no algorithm. A trainer is
vectorised only if the nearest class defining `vector_term` in its ancestry
is its own class or one from which it differs by nothing it defines.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedcore.kernel import registry
from fedcore.kernel.config import declare
from fedcore.execution.client_conv import with_client_convs
from fedcore.kernel.batch_order import epoch_seed
from fedcore.execution.batching import Engine
from fedcore.kernel.contract import FitResult, Trainer
from fedcore.execution.dense_step import DenseStep
from fedcore.execution.random_layers import MaskFeed, random_layer_reason
from fedcore.wire.serialization import encoded_size
from fedcore.execution.step_graphs import StepGraphs
from fedcore.kernel.vector_term import VectorTerm

__all__ = ["VectorEngine"]

declare("executor.vectorized.cuda_graphs", bool, True,
        "vectorized executor on a CUDA device: run each repeated shape of group's local steps "
        "as one CUDA graph (the same kernels, launched as one unit; FedAvg's local step only)")

_STACK_BYTES = 256 * 2 ** 20   # stack a group's data when it takes at most this much memory
_SCRATCH_BYTES = 32 * 2 ** 20  # the most memory one of the engine's reused buffers keeps

@registry.engines.register("vectorized")
class VectorEngine(Engine):
    name = "vectorized"

    def __init__(self, trainer: Trainer, cfg):
        self.cfg = cfg
        self._buffers: dict[str, torch.Tensor] = {}
        self.names = list(trainer.param_names)
        self.lr = cfg["train.optimizer.lr"]
        self.momentum = cfg["train.optimizer.momentum"]
        self.weight_decay = cfg["train.optimizer.weight_decay"]
        self.batch_size = cfg["train.batch_size"]
        self.seed = cfg["seed"]
        self._generator = torch.Generator()   # re-seeded for every permutation drawn
        self.term = trainer.vector_term()   # `unsupported` has checked that it applies
        self.device = trainer.device
        model, loss = trainer.model, trainer.loss
        if all(p.device.type == "cpu" for p in model.parameters()):
            # on CPU each client's own dense convolution beats vmap's grouped one (and gives
            # the sequential trainer's numbers for it): see fedcore.execution.client_conv
            model = with_client_convs(model)
        # dropout layers multiply by masks drawn from each client's own stream: fedcore.execution.random_layers
        model, self._feed = MaskFeed.install(model, copied=model is not trainer.model)
        self.model = model   # what `functional_call` runs (the trainer's, or a copy of it)
        feed = self._feed

        def objective(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                      masks: tuple[torch.Tensor, ...]):
            if feed is None:
                out = functional_call(model, params, (x,))
            else:
                with feed.replaying(masks):
                    out = functional_call(model, params, (x,))
            if loss == "mse":
                return nn.functional.mse_loss(out.reshape(y.shape), y)
            if y.is_floating_point() or out.dim() != 2:
                return nn.functional.cross_entropy(out, y)
            # Class indices: cross_entropy's own operations (log-softmax, pick, sum, divide by
            # the batch size), the same numbers, in operations that have batching rules - vmap
            # would run nll_loss's decomposition op by op in Python. A label outside
            # [0, classes) (ignore_index) raises here, and the executor falls back to sequential.
            return -torch.log_softmax(out, 1).gather(1, y.unsqueeze(1)).sum() / y.shape[0]
        self._step = vmap(grad_and_value(objective))
        self._first_step = vmap(grad_and_value(objective), in_dims=(None, 0, 0, 0))
        # the same steps as explicit operations, for Flatten/Linear/ReLU stacks
        self._dense = DenseStep.of(model, loss)
        # on a GPU, each repeated shape of group runs as one CUDA graph (fedcore.execution.step_graphs),
        # where the step reads nothing but its inputs (the base term: no per-round constants)
        graphs = (self.device.type == "cuda" and cfg["executor.vectorized.cuda_graphs"]
                  and type(self.term).adjust is VectorTerm.adjust)
        self._graphs = StepGraphs(self._graphed) if graphs else None

    def summary(self) -> dict:
        return {} if self._graphs is None else {"cuda_graph_replays": self._graphs.replays}

    @staticmethod
    def unsupported(trainer, cfg) -> str | None:
        """Why this trainer/config cannot be vectorised, or None if it can."""
        if not isinstance(trainer, Trainer):
            return f"trainer {type(trainer).__name__} is not a fedcore Trainer"
        term, why = _form_of(trainer)
        if term is None:
            return why
        if cfg["train.optimizer.type"] != "sgd":
            return f"train.optimizer.type={cfg['train.optimizer.type']} (only sgd is vectorised)"
        if cfg["train.preserve_optimizer_state"]:
            return "train.preserve_optimizer_state keeps per-client optimizer state"
        if cfg["train.grad_accum_steps"] != 1:
            return "train.grad_accum_steps > 1 (micro-batches are not vectorised)"
        if getattr(trainer, "scheduler", None) is not None:
            return "train.scheduler changes the learning rate step by step"
        if trainer._local_init:
            return "federate.share_params keeps some entries local"
        for name, m in trainer.model.named_modules():
            kept = [b for b, _ in m.named_buffers(recurse=False) if b not in m._non_persistent_buffers_set]
            if kept:
                return (f"layer {name or 'model'} ({type(m).__name__}) has buffers that keep "
                        f"state ({', '.join(kept)}; such as batch norm's running statistics)")
        random = random_layer_reason(trainer.model, trainer.device)
        if random is not None:
            return random
        trained = set(trainer.param_names)
        frozen = [n for n in trainer.entries if n not in trained]
        if frozen:   # frozen parameters not in the model's state (LoRA's base) are constants
            return f"entry {frozen[0]} of the model's state is not trained (a frozen parameter)"
        if term.names() != list(trainer.param_names):
            return "some trainable parameters are not shared"
        return None

    # ------------------------------------------------------------ the batch
    def fit_many(self, trainer, jobs, received, round_):
        model_in = received["model"]
        if set(model_in) != set(self.names):
            return [None] * len(jobs)
        plans = []
        groups: dict[tuple, list[int]] = {}
        term, batch_size, seed = self.term, self.batch_size, self.seed
        num_steps = term.num_steps
        # the base form's step count depends on the sample count alone: asked once per count
        by_count: dict[int, int] | None = {0: 0} if type(term).num_steps is VectorTerm.num_steps else None
        generator = self._generator
        for i, (cid, data, state) in enumerate(jobs):
            train = data.train
            x, y = train.x, train.y
            n = y.shape[0]   # len(train), without Tensor.__len__'s Python frame
            pos = state.get("sampler")
            epoch, offset = (pos["epoch"], pos["offset"]) if pos is not None else (0, 0)
            if by_count is None:
                steps = num_steps(cid, n, round_) if n else 0
            else:
                steps = by_count.get(n)
                if steps is None:
                    steps = by_count[n] = num_steps(cid, n, round_)
            idx, sizes, end = _draw(n, batch_size, seed, cid, epoch, offset, steps, generator)
            plans.append((train, idx, end, n, cid))
            key = (sizes, x.shape[1:], x.dtype, y.shape[1:], y.dtype)
            members = groups.get(key)
            if members is None:
                groups[key] = [i]
            else:
                members.append(i)
        out: list[Any] = [None] * len(jobs)
        trainer.model.train()
        for sig, members in groups.items():
            if len(members) < 2:
                continue   # nothing to batch with: the trainer itself is faster for one client
            states = [jobs[i][2] for i in members]
            ctx = term.prepare(received, states)
            steps = len(sig[0])
            group_plans = [plans[i] for i in members]
            masks = None if self._feed is None else self._feed.draws(
                [p[4] for p in group_plans], round_, seed, sig[0], group_plans[0][0].x, self.device)
            params, losses = self._train_group(model_in, group_plans, sig[0], ctx, masks)
            work = float(sum(sig[0]))
            results = term.finish(ctx, received, params, steps, states, [p[3] for p in group_plans])
            sizes: dict[int, int] = {}   # a group's contents differ only in num_samples
            for i, plan, (content, new_state), loss in zip(members, group_plans, results, losses):
                new_state["sampler"] = plan[2]
                metrics = {"train_loss": loss / steps} if steps else {}
                size = sizes.get(plan[3])
                if size is None:
                    size = sizes[plan[3]] = encoded_size(content)
                out[i] = (FitResult(content, work, metrics, (content, size)), new_state)
        return out

    def _stacked(self, plans: list, sizes: tuple[int, ...]):
        """The group's samples and every step's batch rows in them, on the engine's device:
        (xs, ys, rows), with step s's batches at rows[c * sum(sizes[:s]):][:c * sizes[s]],
        client after client; None when the group's data together are too large to stack
        (`_STACK_BYTES`; then each step gathers its batches itself).

        The samples are concatenated into a buffer the engine keeps (up to `_SCRATCH_BYTES`)
        rather than a fresh allocation, which the OS would zero-fill page by page every round.
        All steps' rows are made at once and moved in one copy; data kept in CPU memory for a
        GPU are gathered there and moved once, as the steps' batches in order."""
        x0 = plans[0][0].x
        total = sum(p[3] for p in plans)
        if total * x0[0].numel() * x0.element_size() > _STACK_BYTES:
            return None
        shape = tuple(x0.shape[1:])
        xs = torch.cat([p[0].x for p in plans],   # all clients' samples, in turn
                       out=self._scratch("xs", (total,) + shape, x0.dtype, x0.device))
        ys = torch.cat([p[0].y for p in plans])
        first = torch.tensor(list(itertools.accumulate((p[3] for p in plans[:-1]), initial=0)))
        rows = torch.cat([(torch.stack([p[1][s] for p in plans]) + first.unsqueeze(1)).view(-1)
                          for s in range(len(sizes))])
        if xs.device != self.device:
            xs, ys = xs.index_select(0, rows).to(self.device), ys.index_select(0, rows).to(self.device)
            return xs, ys, torch.arange(len(rows), device=self.device)
        if rows.device != self.device:
            pinned = self.device.type == "cuda"
            rows = (rows.pin_memory() if pinned else rows).to(self.device, non_blocking=pinned)
        return xs, ys, rows

    def _indexed(self, xs: torch.Tensor, ys: torch.Tensor, rows: torch.Tensor,
                 sizes: tuple[int, ...], c: int, scratch: bool = True):
        """Each step's mini-batches, as [clients, batch, ...] tensors, from `_stacked`'s
        output (the inputs written into a kept buffer with `scratch`)."""
        shape, yshape = tuple(xs.shape[1:]), tuple(ys.shape[1:])
        at = 0
        for b in sizes:
            r = rows[at:at + c * b]
            at += c * b
            out = self._scratch("xb", (c * b,) + shape, xs.dtype, xs.device) if scratch else None
            yield (torch.index_select(xs, 0, r, out=out).view((c, b) + shape),
                   ys.index_select(0, r).view((c, b) + yshape))

    def _scratch(self, slot: str, shape: tuple, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of `shape`, in a buffer kept for `slot` when it is small
        enough (its contents are overwritten by the next use of the slot)."""
        numel = math.prod(shape)
        if numel * dtype.itemsize > _SCRATCH_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = self._buffers.get(slot)
        if buf is None or buf.dtype != dtype or buf.numel() < numel or buf.device != device:
            buf = self._buffers[slot] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    @staticmethod
    def _gather(plans: list, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `s`'s mini-batches of all clients of a group, written straight into one tensor."""
        x0, y0 = plans[0][0].x, plans[0][0].y
        b = len(plans[0][1][s])
        xb = torch.empty((len(plans), b) + tuple(x0.shape[1:]), dtype=x0.dtype, device=x0.device)
        yb = torch.empty((len(plans), b) + tuple(y0.shape[1:]), dtype=y0.dtype, device=y0.device)
        for j, (train, idx, *_) in enumerate(plans):
            torch.index_select(train.x, 0, idx[s].to(x0.device), out=xb[j])
            torch.index_select(train.y, 0, idx[s].to(y0.device), out=yb[j])
        return xb, yb

    def _train_group(self, model_in: dict[str, torch.Tensor], plans: list,
                     sizes: tuple[int, ...], ctx=None, masks: list | None = None):
        """The group's trained parameters (stacked) and each client's summed loss."""
        c = len(plans)
        # The first step starts every client from the same received tensors (not batched,
        # not copied); its update creates each client's own stacked parameters.
        params = {n: model_in[n].detach() for n in self.names}
        if not sizes:   # clients without training data send the received model back
            return {n: p.unsqueeze(0).repeat((c,) + (1,) * p.dim()) for n, p in params.items()}, [0.0] * c
        stacked = self._stacked(plans, sizes)
        if stacked is None:
            batches = ((xb.to(self.device), yb.to(self.device))
                       for xb, yb in (self._gather(plans, s) for s in range(len(sizes))))
            params, loss = self._descend(params, batches, masks, ctx)
        elif self._graphs is not None and ctx is None:
            params, loss = self._graphs((sizes, c), *stacked, params, masks)
        else:
            params, loss = self._descend(params, self._indexed(*stacked, sizes, c), masks, ctx)
        return params, loss.tolist()

    def _graphed(self, sizes_c: tuple, xs, ys, rows, params, masks):
        """The descent as `StepGraphs` captures it: from its inputs alone."""
        sizes, c = sizes_c
        return self._descend(params, self._indexed(xs, ys, rows, sizes, c, scratch=False), masks)

    @torch.no_grad()
    def _descend(self, params: dict[str, torch.Tensor], batches, masks: list | None = None, ctx=None):
        """SGD over `batches` from `params` (one set for all clients, or stacked): the stacked
        parameters after it and each client's summed loss (a float64 tensor)."""
        term = self.term
        params = dict(params)   # the caller's dict keeps its tensors (a graph's inputs)
        bufs: dict[str, torch.Tensor] = {}
        loss_sum = None
        dense = self._dense
        for s, (xb, yb) in enumerate(batches):
            if dense is not None and dense.applies(xb, yb):
                grads, loss = dense(params, xb, yb, shared=not s)
            else:
                with torch.enable_grad():
                    step_masks = () if masks is None else masks[s]
                    grads, loss = (self._step if s else self._first_step)(params, xb, yb, step_masks)
            loss_sum = loss.double() if loss_sum is None else loss_sum.add_(loss.double())
            # gradients that share memory (an LSTM's two biases get one tensor) cannot take new
            # parameters in place: writing one would change the other's gradient
            shared = _shared_memory(grads) if not s else ()
            for n in self.names:
                d = term.adjust(ctx, n, grads[n], params[n])
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
                elif d is grads[n] and n not in shared:
                    # the gradients' own fresh [c, ...] buffer takes the new parameters: no
                    # second buffer of the group's size to allocate (and fault in) each batch
                    params[n] = torch.add(params[n], d, alpha=-self.lr, out=d)
                else:
                    params[n] = torch.add(params[n], d, alpha=-self.lr)   # broadcasts to [c, ...]
        return params, loss_sum


def _shared_memory(tensors: dict[str, torch.Tensor]) -> set[str]:
    """Names of the tensors whose memory another of them also uses."""
    owners: dict[int, list[str]] = {}
    for n, t in tensors.items():
        owners.setdefault(t.untyped_storage().data_ptr(), []).append(n)
    return {n for names in owners.values() if len(names) > 1 for n in names}


def _draw(n: int, batch_size: int, seed: int, client_id: int, epoch: int, offset: int,
          steps: int, generator: torch.Generator) -> tuple[list[torch.Tensor], tuple[int, ...], dict]:
    """The next `steps` batches of client `client_id`'s `BatchStream` from position
    (epoch, offset): their indices, their sizes and the position after them. Each epoch's
    permutation is drawn only when a batch needs it (a client resumed at the end of an epoch
    would otherwise draw one it never uses), with `generator` re-seeded for it: one generator
    for all clients, not one object per client."""
    idx, sizes = [], []
    perm = None
    for _ in range(steps):
        if offset >= n:
            epoch, offset, perm = epoch + 1, 0, None
        if perm is None:
            perm = torch.randperm(n, generator=generator.manual_seed(epoch_seed(seed, client_id, epoch)))
        size = min(batch_size, n - offset)
        idx.append(perm if size == n else perm[offset:offset + size])
        sizes.append(size)
        offset += size
    return idx, tuple(sizes), {"epoch": epoch, "offset": offset}


def _form_of(trainer) -> tuple[VectorTerm | None, str | None]:
    """The trainer's vectorised form, from the nearest class in its ancestry that defines
    `vector_term`, provided no class before it defines anything of its own (it may change
    the local step in a way the form does not know); else (None, why)."""
    changed: list[str] = []
    for klass in type(trainer).__mro__:
        if "vector_term" in vars(klass):
            break
        changed += [n for n in vars(klass) if not (n.startswith("__") and n.endswith("__"))
                    and n not in changed]
    if changed:
        return None, (f"trainer {type(trainer).__name__} changes {', '.join(changed)} without a "
                      "vector_term of its own")
    form = getattr(trainer, "vector_term", None)
    term = form() if callable(form) else None
    if term is None:
        return None, f"trainer {type(trainer).__name__} has no vectorised form (vector_term)"
    return term, None
