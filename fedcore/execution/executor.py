"""Executors: how a course runs the local trainings its clients are asked for.

The handlers never change: a client's `receiving_models` handler calls
`course.trainer.fit(...)` as always. What changes is what stands behind
`course.trainer`. `sequential` is the trainer itself. `vectorized`,
`processes` and `ray` put a batching front in place: when the server sends
one model to many clients, the front notes the receivers; at the first of
those deliveries it trains all of them at once (vectorised over stacked
parameters, spread over worker processes, or over Ray actors) and hands each client's handler its own
result when its delivery comes. Virtual timestamps, byte counts and the
order of events are untouched, so a course gives the same numbers whichever
executor runs it.

Behaviours change the training through declared wrappers (`fedcore.kernel.hooks`), which say what
each executor needs: a course with a wrapper its executor cannot run is refused when it is
built, in one line, never run another way than asked.
"""
from __future__ import annotations

import logging

from fedcore.kernel.batch_order import own_randomness
from fedcore.kernel.config import declare, positive
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import refusal

__all__ = ["EXECUTORS", "apply_torch_threads", "install_executor", "close_executor"]

log = logging.getLogger("fedcore.executor")

EXECUTORS = ("sequential", "vectorized", "processes", "ray")

declare("executor", str, "sequential",
        "how local trainings run: sequential (one after another), vectorized (clients that "
        "receive the same model train together with torch.func over stacked parameters), "
        "processes (a pool of worker processes, one per core), ray (actors on a Ray cluster, or a "
        "local Ray; see executor.ray.*); a behaviour whose wrapper of the trainer's fit the "
        "executor cannot run is refused when the course is built", choices=EXECUTORS)
declare("executor_workers", int, None,
        "processes executor: worker processes (default: the number of usable cores); ray "
        "executor: actors (default: as many as the cluster's resources hold)",
        check=positive)
declare("torch_threads", int, 1,
        "torch intra-op threads for this process; 1 suits the small models simulations train one "
        "client at a time (more threads spin and wait on each other); null leaves torch's own "
        "choice (all cores), which helps large models", nullable=True,
        check=positive)


def apply_torch_threads(cfg) -> None:
    """Set torch's intra-op thread count from `torch_threads` (null: leave torch's choice)."""
    import torch
    if cfg["torch_threads"] is not None:
        torch.set_num_threads(cfg["torch_threads"])


def install_executor(course) -> None:
    """Apply `torch_threads`, give every fit its client's own random stream, put the configured
    executor in front of `course.trainer` and say in one line how the course will train. A
    behaviour whose wrapper of the trainer's fit the executor cannot run is a `ConfigError`."""
    cfg = course.cfg
    apply_torch_threads(cfg)
    kind = cfg["executor"]
    own_randomness(course.trainer, cfg["seed"])
    if kind == "sequential":
        return
    refused = refusal(course.trainer, kind)
    if refused is not None:
        raise ConfigError(refused)
    from fedcore.execution.batching import BatchingTrainer
    course.trainer = BatchingTrainer.install(course, kind)
    if type(course.trainer) is BatchingTrainer:
        log.info("executor %s: the clients of each broadcast train together", kind)


def close_executor(course) -> None:
    """Release the executor's resources (worker processes) at the end of a run, and record in
    the summary how many fits ran batched and how many one at a time."""
    trainer = course.trainer
    close = getattr(type(trainer), "close", None)
    if close is not None:
        close(trainer)
    batched = getattr(trainer, "batched_fits", 0)
    sequential = getattr(trainer, "sequential_fits", None)
    if sequential is None:
        sequential = getattr(trainer, "own_fits", 0)
    engine = getattr(trainer, "engine_summary", None)
    course.monitor.add_summary("executor", {"batched_fits": batched, "sequential_fits": sequential,
                                            **(engine() if engine is not None else {})})
