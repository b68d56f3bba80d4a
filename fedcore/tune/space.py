"""A search space over config keys, read from YAML.

    train.optimizer.lr: {type: float, low: 0.001, high: 1.0, log: true}
    train.local_steps: {type: int, low: 1, high: 8}
    train.optimizer.type: {type: choice, values: [sgd, adam]}

Each dotted key must be a declared config key; its values are checked against
the key's type, so a typo or a bad range fails at once (exit 2, one line), not
after hours of trials. Grid search needs finitely many points: a float or int
range contributes `grid` points (default 5) evenly spaced in its own scale.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedcore.kernel.config import SCHEMA, load_builtin_plugins, nearest_key, read_yaml_file
from fedcore.kernel.errors import ConfigError

__all__ = ["Param", "SearchSpace", "load_space"]

TYPES = ("float", "int", "choice")
DEFAULT_GRID = 5


@dataclass(frozen=True)
class Param:
    """One dimension: a uniform or log-uniform float or int range, or a list of choices."""

    key: str
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    values: tuple = ()
    grid: int = DEFAULT_GRID

    def sample(self, rng: np.random.Generator) -> Any:
        if self.type == "choice":
            return self.values[int(rng.integers(len(self.values)))]
        if self.type == "float":
            if self.log:
                return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
            return float(rng.uniform(self.low, self.high))
        if self.log:  # int: log-uniform over [low, high + 1), floored
            return int(min(self.high, math.floor(math.exp(
                rng.uniform(math.log(self.low), math.log(self.high + 1))))))
        return int(rng.integers(self.low, self.high + 1))

    def grid_values(self) -> list[Any]:
        if self.type == "choice":
            return list(self.values)
        n = self.grid
        if self.type == "int" and self.high - self.low + 1 <= n:
            return list(range(int(self.low), int(self.high) + 1))
        if self.log:
            points = np.exp(np.linspace(math.log(self.low), math.log(self.high), n))
        else:
            points = np.linspace(self.low, self.high, n)
        if self.type == "int":
            return sorted({int(round(p)) for p in points})
        return [float(f"{p:.12g}") for p in points]  # 0.1, not 0.10000000000000006


class SearchSpace:
    """The dimensions of a search, in the order the YAML lists them."""

    def __init__(self, params: list[Param]):
        if not params:
            raise ConfigError("--space: the search space names no config key; add at least one, "
                              "e.g. train.optimizer.lr: {type: float, low: 0.01, high: 1.0, log: true}")
        self.params = params

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.params]

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        return {p.key: p.sample(rng) for p in self.params}

    def grid(self) -> list[dict[str, Any]]:
        """Every combination of the dimensions' grid values (the first dimension varies slowest)."""
        return [dict(zip(self.keys, combo))
                for combo in itertools.product(*(p.grid_values() for p in self.params))]

    def suggest(self, trial) -> dict[str, Any]:
        """The values an Optuna trial proposes (its sampler decides)."""
        out = {}
        for p in self.params:
            if p.type == "float":
                out[p.key] = trial.suggest_float(p.key, p.low, p.high, log=p.log)
            elif p.type == "int":
                out[p.key] = trial.suggest_int(p.key, int(p.low), int(p.high), log=p.log)
            else:
                out[p.key] = trial.suggest_categorical(p.key, list(p.values))
        return out

    @classmethod
    def from_mapping(cls, tree: Any, where: str = "--space") -> "SearchSpace":
        if not isinstance(tree, dict):
            raise ConfigError(f"{where}: must hold a mapping of config keys to "
                              "{type: float|int|choice, ...}")
        load_builtin_plugins()
        flat: dict[str, Any] = {}
        _flatten(tree, "", flat, where)
        return cls([_param(k, spec, where) for k, spec in flat.items()])


def load_space(path: str | Path | dict) -> SearchSpace:
    """A search space from a YAML file (or an already-parsed mapping)."""
    if isinstance(path, dict):
        return SearchSpace.from_mapping(path, "space")
    p = Path(path)
    return SearchSpace.from_mapping(read_yaml_file(p, "--space"), f"--space {p}")


def _flatten(tree: dict, prefix: str, out: dict, where: str) -> None:
    """Nested sections (train: {optimizer: {lr: {...}}}) or dotted keys; a leaf is a declared
    key, or has a string `type` (a section may hold a key named `type`, as train.optimizer does)."""
    for name, value in tree.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict) and not isinstance(value.get("type"), str) and dotted not in SCHEMA:
            _flatten(value, dotted + ".", out, where)
        else:
            out[dotted] = value


def _param(key: str, spec: Any, where: str) -> Param:
    declared = SCHEMA.get(key)
    if declared is None:
        raise ConfigError(f"{where}: unknown config key '{key}'{nearest_key(key)}")
    if not isinstance(spec, dict) or spec.get("type") not in TYPES:
        raise ConfigError(f"{where}: {key} needs {{type: float|int|choice, ...}}, got {spec!r}")
    kind = spec["type"]
    allowed = {"float": {"type", "low", "high", "log", "grid"}, "int": {"type", "low", "high", "log", "grid"},
               "choice": {"type", "values"}}[kind]
    extra = sorted(set(spec) - allowed)
    if extra:
        raise ConfigError(f"{where}: {key}: unknown field '{extra[0]}' for type {kind} "
                          f"(allowed: {', '.join(sorted(allowed))})")
    if kind == "choice":
        values = spec.get("values")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: {key}: choice needs a non-empty list under 'values'")
        for v in values:
            _check_value(declared, key, v, where)
        return Param(key, kind, values=tuple(values))
    if declared.type not in (int, float) or (kind == "float" and declared.type is int):
        raise ConfigError(f"{where}: {key} is a {declared.type.__name__} key; a {kind} range cannot "
                          "set it (use type: choice)")
    low, high = spec.get("low"), spec.get("high")
    number = (int,) if kind == "int" else (int, float)
    for name, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, number):
            raise ConfigError(f"{where}: {key}: '{name}' must be {'an int' if kind == 'int' else 'a number'}, "
                              f"got {v!r}")
    if not low < high:
        raise ConfigError(f"{where}: {key}: low ({low}) must be below high ({high})")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"{where}: {key}: 'log' must be true or false")
    if log and low <= 0:
        raise ConfigError(f"{where}: {key}: a log range needs low > 0 (got {low})")
    grid = spec.get("grid", DEFAULT_GRID)
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 2:
        raise ConfigError(f"{where}: {key}: 'grid' must be an int >= 2 (points for grid search)")
    for v in (low, high):
        _check_value(declared, key, float(v) if kind == "float" else v, where)
    return Param(key, kind, float(low) if kind == "float" else low, float(high) if kind == "float" else high,
                 log, (), grid)


def _check_value(declared, key: str, value: Any, where: str) -> None:
    """The key's own type and checks, so a trial never fails on a value the space allows."""
    from fedcore.kernel.config import _coerce
    try:
        _coerce(declared, value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
