"""Options of the client's inner loop: gradient accumulation and an LR schedule.

Both are counted in completed optimizer steps. `train.grad_accum_steps` micro-batches
make one optimizer step; the schedule advances once per optimizer step, and its
state (like the optimizer's) belongs to the logical client, so it is swapped in and
out of the client's state store by the trainer.
"""
from __future__ import annotations

import math

import torch

from fedcore.kernel.config import declare, non_negative, validator
from fedcore.kernel.errors import ConfigError

__all__ = ["build_scheduler", "lr_factor"]

declare("train.grad_accum_steps", int, 1, "micro-batches of train.batch_size whose gradients are "
        "accumulated into one optimizer step; local_steps counts optimizer steps only",
        check=lambda v: None if v >= 1 else "must be >= 1")
declare("train.scheduler.type", str, "none", "client LR schedule over the client's own optimizer "
        "steps: none, or cosine (linear warmup, then cosine decay to min_lr_ratio x lr)",
        choices=("none", "cosine"))
declare("train.scheduler.warmup_steps", int, 0, "cosine: optimizer steps of linear warmup",
        check=non_negative)
declare("train.scheduler.total_steps", int, None, "cosine: optimizer steps (warmup included) "
        "after which the LR stays at min_lr_ratio x lr; counted within each fit, or over the "
        "course with train.preserve_optimizer_state",
        check=lambda v: None if v >= 1 else "must be >= 1")
declare("train.scheduler.min_lr_ratio", float, 0.0, "cosine: final LR as a fraction of lr",
        check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")


@validator
def _check_scheduler(cfg) -> None:
    if cfg["train.scheduler.type"] != "cosine":
        return
    total = cfg["train.scheduler.total_steps"]
    if total is None:
        over = ("the optimizer steps a client takes over the course" if cfg["train.preserve_optimizer_state"]
                else "the optimizer steps of one fit: the schedule starts again with each fit unless "
                     "train.preserve_optimizer_state is true")
        raise ConfigError(f"train.scheduler.total_steps: required by train.scheduler.type=cosine "
                          f"(set it to {over})")
    if cfg["train.scheduler.warmup_steps"] > total:
        raise ConfigError(f"train.scheduler.warmup_steps: {cfg['train.scheduler.warmup_steps']} "
                          f"exceeds train.scheduler.total_steps {total}")


def lr_factor(t: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier for a client's optimizer step number `t` (0-based).

    Warmup: (t + 1) / warmup for t < warmup. Then cosine from 1 down to `min_ratio`
    over the remaining `total - warmup` steps, and `min_ratio` after that.
    """
    if t < warmup:
        return (t + 1) / warmup
    progress = min(1.0, (t - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The configured schedule on `optimizer`, or None for `train.scheduler.type: none`."""
    s = cfg.section("train.scheduler")
    if s["type"] == "none":
        return None
    warmup, total, floor = s["warmup_steps"], s["total_steps"], s["min_lr_ratio"]
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: lr_factor(t, warmup, total, floor))
