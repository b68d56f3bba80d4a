"""Typed state: what a behaviour keeps on a worker (the server, an edge) between events.

A behaviour declares its state once, as a dataclass registered under a name,

    @worker_state("admission")
    @dataclass
    class AdmissionState:
        declared: dict[int, int] = field(default_factory=dict)
        log: QuietLog = transient(lambda: QuietLog(log))

and reads it through one accessor, `server.state(AdmissionState)`, which creates it with its
defaults on first use. The worker holds all of them in `worker.states`, so a checkpoint saves
every behaviour's state without knowing any of them: `saved()` turns each into plain data
(tensors, numbers, strings, and lists, tuples, sets, dicts and dataclasses of those, which
`torch.load(weights_only=True)` reads back), and `decode()` rebuilds them, checking each value
against the field's type, so a corrupted entry is refused in one line and never half-restored.

A field that means nothing after a restart (a wall-clock rate limiter, live connections, reply
timers) is `transient`: not saved, and back to its default after a resume. A class whose whole
state is such sets `transient = True` and is left out of snapshots.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any, Callable, TypeVar


__all__ = ["StateError", "worker_state", "transient", "WorkerStates", "StateHolder", "Outcome",
           "registered_states"]

S = TypeVar("S")

_REGISTERED: dict[str, type] = {}


class StateError(ValueError):
    """A state class that is not registered, or a saved entry that does not fit its class."""


def worker_state(name: str) -> Callable[[type[S]], type[S]]:
    """Register a dataclass as the state named `name` (the key it is saved under)."""
    def add(cls: type[S]) -> type[S]:
        if not dataclasses.is_dataclass(cls):
            raise StateError(f"{cls.__qualname__}: a worker state must be a dataclass")
        other = _REGISTERED.get(name)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise StateError(f"worker state '{name}' is already {other.__qualname__}'s")
        _REGISTERED[name] = cls
        cls.state_name = name
        return cls
    return add


def registered_states() -> dict[str, type]:
    """name -> class of every registered state (those of the modules imported so far)."""
    return dict(_REGISTERED)


def transient(default_factory: Callable[[], Any]) -> Any:
    """A dataclass field that is not saved: meaningless across a restart (say why where used)."""
    return dataclasses.field(default_factory=default_factory, metadata={"transient": True})


def _name_of(cls: type) -> str:
    name = getattr(cls, "state_name", None)
    if name is None or _REGISTERED.get(name) is not cls:
        raise StateError(f"{getattr(cls, '__qualname__', cls)} is not a registered worker state; "
                         "declare it with @worker_state(name)")
    return name


class WorkerStates:
    """A worker's typed states, one per class, created on first use."""

    def __init__(self) -> None:
        self._by_name: dict[str, Any] = {}

    def get(self, cls: type[S]) -> S:
        name = _name_of(cls)
        state = self._by_name.get(name)
        if state is None:
            state = self._by_name[name] = cls()
        return state

    def __contains__(self, cls: type) -> bool:
        return _name_of(cls) in self._by_name

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def saved(self) -> dict[str, dict[str, Any]]:
        """name -> plain fields of every state that is not transient (copies: a snapshot kept
        for later must not change with the live state)."""
        return {name: _plain(state) for name, state in sorted(self._by_name.items())
                if not getattr(state, "transient", False)}

    def restore(self, decoded: dict[str, Any], worker: Any) -> None:
        """Put `decode()`'s states in: a state this worker holds already (made when its
        behaviour was installed) takes the saved fields and keeps its transient ones."""
        for name, state in decoded.items():
            live = self._by_name.setdefault(name, state)
            if live is not state:
                for f in dataclasses.fields(state):
                    if not f.metadata.get("transient"):
                        setattr(live, f.name, getattr(state, f.name))
            hook = getattr(live, "restored", None)
            if hook is not None:
                hook(worker)


class StateHolder:
    """What a worker needs to hold typed states: `self.state(Cls)`."""

    states: WorkerStates

    def state(self, cls: type[S]) -> S:
        return self.states.get(cls)


def decode(saved: Any) -> dict[str, Any]:
    """The states of a snapshot's `states` entry, each checked against its registered class."""
    if not isinstance(saved, dict):
        raise StateError(f"states: a map of state names, not {type(saved).__name__}")
    out = {}
    for name, fields in saved.items():
        cls = _REGISTERED.get(name) if isinstance(name, str) else None
        if cls is None:
            raise StateError(f"state '{name}' is not one that this course's behaviours register")
        out[name] = _value(fields, cls, name)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("transient")}
    if _is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(_plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise StateError(f"a worker state holds a {type(value).__name__}, which a snapshot cannot "
                     "save; make its field transient or plain data")


def _is_tensor(value: Any) -> bool:
    """A torch tensor (torch is not imported for it: a torch-less client holds none)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _value(value: Any, hint: Any, where: str) -> Any:
    """`value` as the type `hint` says (a dataclass rebuilt from its fields), or StateError."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if value is None and len(arms) < len(args):
            return None
        if len(arms) == 1:   # an Optional: what is wrong with the value is the one arm's to say
            return _value(value, arms[0], where)
        for arm in arms:
            try:
                return _value(value, arm, where)
            except StateError:
                pass
        raise _unfit(value, hint, where)
    if hint is None or hint is type(None):
        if value is None:
            return None
        raise _unfit(value, hint, where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _unfit(value, hint, where)
        hints = typing.get_type_hints(hint)
        kept = [f for f in dataclasses.fields(hint) if not f.metadata.get("transient") and f.init]
        unknown = set(value) - {f.name for f in kept}
        if unknown:
            raise StateError(f"{where}: no field '{sorted(map(str, unknown))[0]}' in {hint.__qualname__}")
        return hint(**{f.name: _value(value[f.name], hints[f.name], f"{where}.{f.name}")
                       for f in kept if f.name in value})
    if origin is dict:
        if not isinstance(value, dict):
            raise _unfit(value, hint, where)
        k, v = args or (Any, Any)
        return {_value(a, k, where): _value(b, v, f"{where}[{a!r}]") for a, b in value.items()}
    if origin in (list, set, frozenset):
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise _unfit(value, hint, where)
        (item,) = args or (Any,)
        return origin(_value(v, item, where) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _unfit(value, hint, where)
        items = args if not (len(args) == 2 and args[1] is Ellipsis) else (args[0],) * len(value)
        if args and len(items) != len(value):
            raise _unfit(value, hint, where)
        return tuple(_value(v, t, where) for v, t in zip(value, items)) if args else tuple(value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise _unfit(value, hint, where)
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise _unfit(value, hint, where)


def _unfit(value: Any, hint: Any, where: str) -> StateError:
    shown = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    return StateError(f"{where} is a {type(value).__name__}, not {shown}")


@worker_state("outcome")
@dataclasses.dataclass
class Outcome:
    """Why a course ends with its own exit code, once the outputs are written: the course
    diverged (admission rejected the aggregate), or a secure course aggregated no round."""
    diverged: str | None = None
    unaggregated: str | None = None
