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
import os

from fedcore.kernel.batch_order import own_randomness
from fedcore.kernel.config import declare, positive
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import refusal

__all__ = ["EXECUTORS", "apply_torch_threads", "install_executor", "close_executor", "usable_cores"]

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
declare("torch_threads", int, "auto",
        "torch intra-op threads for this process. auto: every usable core (OMP_NUM_THREADS where "
        "set) for a simulation that trains in this process (executor sequential or vectorized, on "
        "the CPU) when a local training step is at least 50 MFLOP, a sequential one going back to "
        "1 while its fits measure no faster with them (other work on the machine); 1 otherwise, "
        "and in deployed processes, which often share a machine (threads of a small model's step "
        "only wait on each other); a number sets it; null leaves torch's own choice (all cores)",
        nullable=True, check=positive, words=("auto",))

# a training step of at least this many MFLOP gets every usable core: on 2 cores, 2 threads
# took 0.94-1.04x one thread's time per step from 0.3 to 26 MFLOP (no gain past the noise),
# 0.61-0.66x from 72 (LeNet-5, batch 32) to 916 (P1's CNN) (python -m bench.threads)
AUTO_THREADS_MFLOP = 50.0


def apply_torch_threads(cfg, course=None) -> None:
    """Set torch's intra-op thread count from `torch_threads` (null: leave torch's choice;
    auto: decided from `course`'s training step, 1 without a course)."""
    import torch
    n = cfg["torch_threads"]
    if n == "auto":
        n = auto_threads(course)
    if n is not None:
        torch.set_num_threads(n)


def auto_threads(course) -> int:
    """`torch_threads: auto`: the cores this process may use when the course trains here, on
    the CPU, with a step large enough to share; else 1."""
    if course is None or course.cfg["executor"] not in ("sequential", "vectorized") \
            or course.device.type != "cpu":
        return 1
    cores = _allowed_cores()
    if cores == 1:
        return 1
    mflop = step_mflop(course)
    n = cores if mflop is not None and mflop >= AUTO_THREADS_MFLOP else 1
    log.log(logging.INFO if n > 1 else logging.DEBUG,
            "torch_threads auto: %d (a local training step of %s MFLOP; %g or more use every core)",
            n, "?" if mflop is None else f"{mflop:.3g}", AUTO_THREADS_MFLOP)
    return n


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _allowed_cores() -> int:
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return max(1, min(int(env), usable_cores())) if env.isdigit() else usable_cores()


def step_mflop(course) -> float | None:
    """Floating-point operations (in millions) of one local step, forward and backward, on a
    batch of zeros shaped as the first client's inputs (None where the model cannot count one).
    Counted in eval mode under a forked random state: no buffer, gradient or draw of the course
    changes. Counted first on the meta device (shapes only: a large model's gradients are
    never made), else on the model's own."""
    import torch
    model = getattr(course.trainer, "model", None)
    if not isinstance(model, torch.nn.Module):   # a trainer without a torch model (train.backend: numpy)
        return None
    was_training = model.training
    try:
        x = course.data.clients[min(course.client_ids)].train.x   # (data made on access: no keys)
        shape = (course.cfg["train.batch_size"],) + tuple(x.shape[1:])
        with torch.random.fork_rng(devices=[]):
            model.eval()
            for device in ("meta", None):
                try:
                    return _count_step(model, torch.zeros(shape, dtype=x.dtype, device=device or x.device),
                                       meta=device is not None)
                except Exception as exc:  # noqa: BLE001 - a model that needs more than a batch of inputs
                    log.debug("torch_threads auto: no step counted on %s (%s)", device or x.device, exc)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return None


def _count_step(model, batch, meta: bool) -> float:
    """MFLOP of the forward and backward of `model` on `batch`; with `meta`, through meta
    copies of its parameters and buffers (`functional_call`), the model untouched."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        if meta:
            state = {n: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
                     for n, t in model.state_dict(keep_vars=True).items()}
            out = torch.func.functional_call(model, state, (batch,))
        else:
            out = model(batch)
        out = out if isinstance(out, torch.Tensor) else out[0]
        out.float().sum().backward()
    return counter.get_total_flops() / 1e6


def install_executor(course) -> None:
    """Apply `torch_threads`, give every fit its client's own random stream, put the configured
    executor in front of `course.trainer` and say in one line how the course will train. A
    behaviour whose wrapper of the trainer's fit the executor cannot run is a `ConfigError`."""
    cfg = course.cfg
    apply_torch_threads(cfg, course)
    kind = cfg["executor"]
    own_randomness(course.trainer, cfg["seed"])
    if kind == "sequential" and cfg["torch_threads"] == "auto":
        import torch
        if torch.get_num_threads() > 1:      # auto gave several: kept while they measure faster
            from fedcore.execution.thread_governor import govern_threads
            govern_threads(course.trainer, torch.get_num_threads())
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
    governor = getattr(trainer, "thread_governor", None)
    threads = ({"fits_by_torch_threads": {str(n): k for n, k in governor.fits_by_count.items()}}
               if governor is not None else {})
    course.monitor.add_summary("executor", {"batched_fits": batched, "sequential_fits": sequential,
                                            **(engine() if engine is not None else {}), **threads})
    if course.cfg["executor"] == "vectorized" and 0 < batched < sequential:
        log.warning("executor vectorized: %d of the course's %d fits ran batched; the others' clients "
                    "shared no batch plan (mini-batch sizes step by step) with another of their round "
                    "(equal training-set sizes, or train.local_steps with a batch size dividing them, "
                    "let them)", batched, batched + sequential)
