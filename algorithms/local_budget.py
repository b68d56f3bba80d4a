"""Time-budgeted local work: each client trains for as long as its device allows in T seconds.

With `train.local_time_budget` T, client i takes

    τ_i = max(1, floor(T · s_i / (b_i · A)))

optimizer steps per round instead of `train.local_steps` / `local_epochs`, with
s_i its device's `compute_speed` (gradient evaluations per second, from
`time.profiles`), b_i = min(`train.batch_size`, n_i) the samples of one
mini-batch and A = `train.grad_accum_steps`: slow devices do less local work,
fast ones more, and every modeled compute time stays within T (one step at
least). The budget is in the profiles' modeled seconds in simulation and in
deployment alike, so a deployed client takes the simulation's steps. This is
where unequal local work comes from in FedNova's setting besides data sizes
and stragglers.
"""
from __future__ import annotations

import math

from fedcore.kernel import registry
from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrapper
from fedcore.runtime.timing import TimeModel

__all__ = ["budget_steps", "install"]

declare("train.local_time_budget", float, None,
        "seconds of modeled compute per round: each client takes max(1, floor(T * compute_speed / "
        "samples per step)) local steps, replacing local_steps/local_epochs", check=positive)


@validator
def _check_budget(cfg) -> None:
    if cfg["train.local_time_budget"] is None:
        return
    name = cfg["algorithm.name"]
    if name == "diloco":
        raise ConfigError("train.local_time_budget: algorithm diloco takes exactly H = train.local_steps "
                          "steps per round; unset the budget")
    if cfg.get(f"algorithm.{name}.straggler_fraction"):
        raise ConfigError(f"algorithm.{name}.straggler_fraction: stragglers and "
                          "train.local_time_budget both set the local steps; set only one")


def budget_steps(budget: float, compute_speed: float, n_train: int, batch_size: int,
                 grad_accum: int = 1) -> int:
    """Optimizer steps a device of `compute_speed` finishes in `budget` seconds (at least 1)."""
    per_step = min(batch_size, n_train) * grad_accum
    return max(1, math.floor(budget * compute_speed / per_step))


def install(course) -> None:
    """Behaviour: the client's trainer takes the budget's steps (client side only)."""
    trainer = course.trainer
    if trainer is None:
        return
    cfg = course.cfg
    budget, batch, accum = (cfg["train.local_time_budget"], cfg["train.batch_size"],
                            cfg["train.grad_accum_steps"])
    # the configured profiles, also in a deployed client (whose own clock measures real time)
    profiles = TimeModel.from_config(cfg, range(1, course.num_clients + 1))
    speed: list[float] = []   # the compute speed of the client being fitted

    def budgeted_fit(fit, client_id, data, received, round_):
        speed.append(profiles.profile(client_id).compute_speed)
        try:
            return fit(client_id, data, received, round_)
        finally:
            speed.pop()

    def budgeted_steps(num_steps, n_train):
        return budget_steps(budget, speed[-1], n_train, batch, accum) if speed else num_steps(n_train)

    # the step count changes the training itself; the trainer's own copy (a worker's) takes it
    trainer.wrap(Wrapper("train.local_time_budget", "num_steps", budgeted_steps, process_safe=True))
    trainer.wrap(Wrapper("train.local_time_budget", "fit", budgeted_fit, process_safe=True))


install.enabled = lambda cfg: cfg["train.local_time_budget"] is not None
registry.behaviours.register("local_time_budget", install)
