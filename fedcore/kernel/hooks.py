"""Behaviours compose with the plug-ins through declared wrappers, not by replacing methods.

A behaviour (local DP, FedEx, a server optimizer, an attack's metric...) that changes what a
trainer's `fit`, `begin`, `num_steps` or `evaluate`, or an aggregator's `aggregate` or
`broadcast`, does declares a
`Wrapper` and hands it to the plug-in's `wrap`. Each plug-in keeps an ordered chain per
method: a call of the method - by the handlers, an executor or a user's own handler - runs the
wrappers from the last wrapped (outermost) to the first, and the plug-in's own method innermost.
The method itself is never replaced; the class dispatches (`Wrappable`), so `super().fit` inside
a plug-in's own method runs the plain method, never the chain a second time.

A wrapper also says what it supports, and the executors read that instead of guessing:
`per_client_result` - it needs only the call's inputs, the inner call's result and the client's
stored state, and draws from no generator but its own, so the vectorized engine applies it
around each client's batched result;
`process_safe` - it touches nothing but the trainer, the client's stored state and the result,
so a worker process or Ray actor runs it on its own copy of the trainer; `deployable` - it works
when clients and server are separate processes (a deployed server or client refuses at build,
in one line, a wrapper that says it does not).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["METHODS", "TRAINING", "Wrapper", "Wrappable", "wrappers", "around_result", "refusal",
           "deployment_refusal"]

# a trainer's round, its start (after the client's state is restored) and step count, its
# evaluation; an aggregator's combination of updates and what it sends
METHODS = ("fit", "begin", "num_steps", "evaluate", "aggregate", "broadcast")
TRAINING = ("fit", "begin", "num_steps")   # what an executor's engine must reproduce


@dataclass(frozen=True)
class Wrapper:
    """One behaviour's change to one method: `around(inner, *args, **kwargs)` returns what the
    method returns, calling `inner` (the rest of the chain) as it needs."""

    behaviour: str
    method: str
    around: Callable[..., Any]
    per_client_result: bool = False
    process_safe: bool = False
    deployable: bool = True
    # what it does around a result computed elsewhere, if not `around` (the client's random
    # stream: the engine drew it already)
    around_result: Callable[..., Any] | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"wrapper {self.behaviour}: method {self.method!r} is not one of {METHODS}")


class Wrappable:
    """Base of the plug-in classes: `wrap` adds to a method's chain, and each of `METHODS` a
    class defines (or a mixin before it brings in) is reached through a dispatch that runs it."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in METHODS:
            # its own method, or one a mixin outside the plug-in classes brought in first
            own = getattr(cls, name, None)
            if inspect.isfunction(own) and not hasattr(own, "_dispatches"):
                setattr(cls, name, _dispatching(name, own))

    def wrap(self, wrapper: Wrapper) -> None:
        """Add `wrapper` outside the method's chain so far: it runs first, around the others."""
        if not callable(getattr(type(self), wrapper.method, None)):
            raise TypeError(f"{type(self).__name__} has no method {wrapper.method!r} to wrap")
        chains = self.__dict__.setdefault("_chains", {})
        chains[wrapper.method] = chains.get(wrapper.method, ()) + (wrapper,)


def wrappers(obj: Any, method: str | None = None) -> tuple[Wrapper, ...]:
    """The wrappers on `obj` (one method's, innermost first, or all of them)."""
    chains = getattr(obj, "_chains", None) or {}
    if method is not None:
        return chains.get(method, ())
    return tuple(w for m in METHODS for w in chains.get(m, ()))


def _call_around(obj: Any, method: str, inner: Callable[..., Any], *args, **kwargs) -> Any:
    """Run `obj`'s chain for `method` around `inner`, its own method."""
    call = inner
    for w in wrappers(obj, method):
        call = functools.partial(w.around, call)
    return call(*args, **kwargs)


def around_result(obj: Any, method: str, result: Any, *args, **kwargs) -> Any:
    """Run `obj`'s chain for `method` around `result`, computed elsewhere for these arguments
    (an executor's batched fit); every wrapper must be `per_client_result`."""
    call: Callable[..., Any] = lambda *_, **__: result
    for w in wrappers(obj, method):
        call = functools.partial(w.around_result or w.around, call)
    return call(*args, **kwargs)


def _dispatching(name: str, own: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(own)
    def dispatch(self, *args, **kwargs):
        state = self.__dict__
        chain = state.get("_chains")
        if not chain or name not in chain or name in state.get("_inside", ()):
            return own(self, *args, **kwargs)

        def plain(*a, **k):
            inside = state.setdefault("_inside", set())
            inside.add(name)
            try:
                return own(self, *a, **k)
            finally:
                inside.discard(name)
        return _call_around(self, name, plain, *args, **kwargs)
    dispatch._dispatches = name
    return dispatch


def refusal(obj: Any, executor: str) -> str | None:
    """Why `executor` cannot run `obj`'s training with its wrappers (one line), or None."""
    bad = _unsupported(obj, executor)
    if not bad:
        return None
    can = ", ".join(e for e in ("sequential", *_NEEDS) if not _unsupported(obj, e))
    return (f"executor {executor} cannot run behaviour {', '.join(dict.fromkeys(bad))}: its wrapper "
            f"of the trainer's training {_NEEDS[executor][1]}; executors that can: {can}")


def deployment_refusal(*objs: Any) -> str | None:
    """Why a deployed process cannot run the wrappers on `objs` (one line), or None."""
    bad = [w.behaviour for obj in objs if obj is not None for w in wrappers(obj) if not w.deployable]
    if not bad:
        return None
    return (f"behaviour {', '.join(dict.fromkeys(bad))} does not run in a deployed course "
            "(its wrapper needs the clients and the server in one process); run it in simulation")


# executor -> (the capability each wrapper of the training needs, why without it)
_NEEDS = {"vectorized": ("per_client_result", "needs more than each client's own result"),
          "processes": ("process_safe", "touches state outside the trainer"),
          "ray": ("process_safe", "touches state outside the trainer")}


def _unsupported(obj: Any, executor: str) -> list[str]:
    need = _NEEDS.get(executor)
    if need is None:
        return []
    return [w.behaviour for m in TRAINING for w in wrappers(obj, m) if not getattr(w, need[0])]
