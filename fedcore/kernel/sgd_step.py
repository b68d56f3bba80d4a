"""Plain SGD's update, p <- p - lr * grad, without `torch.optim`'s per-call machinery.

`torch.optim.SGD.step()` and `zero_grad()` wrap a two-line update in profiling records,
hook dispatch, grad-mode switches and dtype/device grouping: about 35 microseconds per
step on a CPU, a third of a logistic-regression step at batch 10 and more than its
arithmetic. Where nothing can observe the difference the trainer performs the update
itself, with the very operation SGD performs (`add_(grad, alpha=-lr)`, or `_foreach_add_`
where SGD would take its foreach path), so the model is the same bit for bit. Anything
else (momentum, weight decay, `maximize`, a tensor learning rate, a gradient scaler, a
step hook such as DiLoCo's count or central DP's projection, a `step` patched on the
instance as an LR scheduler does, a subclass) goes through `optimizer.step()` as before.
"""
from __future__ import annotations

import torch
from torch.optim import optimizer as _optim_module

__all__ = ["plain_sgd", "sgd_update", "clear_grads"]

_FOREACH_DEVICES = ("cuda", "xpu")   # where SGD's foreach=None picks the foreach path


def plain_sgd(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt.step()` is exactly p <- p - lr * grad for each parameter with a gradient,
    observed by nobody: checked before each step, since hooks come and go within a fit."""
    if type(opt) is not torch.optim.SGD or "step" in vars(opt) or "zero_grad" in vars(opt):
        return False
    if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
        return False
    hooks = (getattr(opt, "_optimizer_step_pre_hooks", None), getattr(opt, "_optimizer_step_post_hooks", None),
             getattr(_optim_module, "_global_optimizer_pre_hooks", None),
             getattr(_optim_module, "_global_optimizer_post_hooks", None))
    if any(h is None or len(h) for h in hooks):   # unknown torch internals: the real step
        return False
    return all(g["momentum"] == 0 and g["weight_decay"] == 0 and not g["maximize"]
               and not g.get("differentiable") and not g.get("fused") and type(g["lr"]) in (float, int)
               for g in opt.param_groups)


@torch.no_grad()
def sgd_update(opt: torch.optim.SGD) -> None:
    """`opt.step()` for an optimizer `plain_sgd` accepted."""
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        grads = [p.grad for p in params]
        lr = group["lr"]
        foreach = group["foreach"]
        if foreach is None:
            foreach = all(p.device.type in _FOREACH_DEVICES for p in params)
        if foreach and not any(g.is_sparse for g in grads):
            torch._foreach_add_(params, grads, alpha=-lr)
        else:
            for p, g in zip(params, grads):
                p.add_(g, alpha=-lr)


def clear_grads(opt: torch.optim.Optimizer) -> None:
    """`opt.zero_grad(set_to_none=True)` without its profiling record."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None
