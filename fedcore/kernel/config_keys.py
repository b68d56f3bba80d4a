"""The config's keys: each declared once with its type, default, allowed values and help line;
the checks a key or a whole config must pass; the nearest key to a misspelt one.

`fedcore.kernel.config` loads, composes and validates configs against this schema, and exports its
names (`declare`, `SCHEMA`, ...) as before.
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from fedcore.kernel.errors import ConfigError

_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", list: "list", dict: "mapping"}


@dataclass(frozen=True)
class Key:
    """One declared config key."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple | Callable[[], Iterable[str]] | None = None
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None
    origin: str = ""  # the module that declared it
    convert: Callable[[Any], Any] | None = None  # applied to a set value before the type check
    words: tuple[str, ...] = ()  # strings a key of another type also takes (torch_threads: auto)

    def allowed(self) -> tuple | None:
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)


SCHEMA: dict[str, Key] = {}
_VALIDATORS: list[Callable[[Any], None]] = []
_RESOLVERS: list[Callable[[dict], None]] = []
_ELSEWHERE: dict[tuple[str, str], str] = {}


def lives_elsewhere(name: str, value: str, where: str) -> None:
    """Say that `name: value` names a feature reached through another key (`where`, e.g.
    "personalization.method=ditto"), so that setting it there is refused with the way to it
    instead of a bare list of choices."""
    _ELSEWHERE[(name, value)] = where


def elsewhere(name: str) -> dict[str, str]:
    """{value: where} of the values of key `name` that `lives_elsewhere` sends to another key."""
    return {value: where for (key, value), where in sorted(_ELSEWHERE.items()) if key == name}


def declare(name: str, type: type, default: Any, help: str, *, choices=None,
            nullable: bool | None = None, check=None, convert=None, words=()) -> Key:
    """Declare a config key. Re-declaring the same key replaces it (module reloads).

    `convert(value)` maps a set value before its type check, so a key can keep accepting an
    older spelling (e.g. `verbose: false` for the level 0). `words` are strings a key of
    another type also takes, as themselves (e.g. `auto` for a number fedcore chooses)."""
    origin = sys._getframe(1).f_globals.get("__name__", "")
    key = Key(name, type, default, help, choices,
              nullable if nullable is not None else default is None, check, origin, convert,
              tuple(words))
    SCHEMA[name] = key
    return key


def positive(v) -> str | None:
    """A `check` for numbers that must be > 0."""
    return None if v > 0 else f"must be > 0, got {v}"


def non_negative(v) -> str | None:
    """A `check` for numbers that must be >= 0."""
    return None if v >= 0 else f"must be >= 0, got {v}"


def fraction(v) -> str | None:
    """A `check` for rates in (0, 1]."""
    return None if 0 < v <= 1 else f"must be in (0, 1], got {v}"


def validator(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    """Register a cross-key check run on every loaded config (a `fedcore.kernel.config.Config`); it
    raises ConfigError."""
    _VALIDATORS.append(fn)
    return fn


def resolver(fn: Callable[[dict], None]) -> Callable[[dict], None]:
    """Register `fn(values)` that derives one key from others (e.g. which course runs) on the
    type-checked values, before validators run and the config is frozen."""
    _RESOLVERS.append(fn)
    return fn


def nearest_key(name: str) -> str:
    """A ' (did you mean ...?)' hint for a mistyped key, or ''."""
    close = difflib.get_close_matches(name, SCHEMA.keys(), n=1, cutoff=0.6)
    if not close:
        leaf = name.rsplit(".", 1)[-1]
        close = [k for k in SCHEMA if k.rsplit(".", 1)[-1] == leaf][:1]
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(key: Key, value: Any) -> Any:
    if key.convert is not None and value is not None:
        value = key.convert(value)
    if value is None:
        if key.nullable:
            return None
        raise ConfigError(f"{key.name}: must not be empty; expected {_TYPE_NAMES[key.type]}")
    if isinstance(value, str) and value in key.words:
        return value
    if key.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if key.type is float and isinstance(value, str):
        try:  # YAML 1.1 reads '1e-3' as a string; accept it as the number it obviously is
            value = float(value)
        except ValueError:
            pass
    ok = isinstance(value, key.type) and not (key.type is int and isinstance(value, bool))
    if not ok:
        expected = " or ".join([_TYPE_NAMES[key.type], *map(repr, key.words)])
        raise ConfigError(f"{key.name}: expected {expected}, got {type(value).__name__} {value!r}")
    allowed = key.allowed()
    if allowed is not None and value not in allowed:
        where = _ELSEWHERE.get((key.name, str(value)))
        if where is not None:
            raise ConfigError(f"{key.name}: {value!r} is reached through another key: set {where}")
        hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint_s = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"{key.name}: {value!r} is not one of {', '.join(map(str, allowed))}{hint_s}")
    if key.check is not None:
        problem = key.check(value)
        if problem:
            raise ConfigError(f"{key.name}: {problem}")
    return value
