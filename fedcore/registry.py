"""Named plug-ins: a config names them, a user's module adds to them.

    from fedcore.registry import models
    @models.register("my_cnn")
    def build(cfg, spec): ...

and `plugins: [my_module]` in the YAML imports that module before the run.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable

from fedcore.errors import ConfigError

__all__ = ["Registry", "algorithms", "datasets", "partitioners", "models", "samplers",
           "courses", "behaviours", "selected_behaviours"]


class Registry:
    """A name -> object table for one kind of plug-in."""

    def __init__(self, kind: str, key: str):
        self.kind = kind
        self.key = key  # the config key that selects from this registry
        self._items: dict[str, Any] = {}

    def register(self, name: str, obj: Any = None) -> Callable:
        """Register `obj` under `name`; usable as a decorator."""
        def add(o: Any) -> Any:
            self._items[name] = o
            return o
        return add(obj) if obj is not None else add

    def get(self, name: str) -> Any:
        try:
            return self._items[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._items, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{self.key}: unknown {self.kind} '{name}'{hint}; "
                              f"known: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def names_in_order(self) -> list[str]:
        """Names in registration order."""
        return list(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


algorithms = Registry("algorithm", "algorithm.name")
datasets = Registry("dataset", "data.type")
partitioners = Registry("partitioner", "data.partition")
models = Registry("model", "model.type")
samplers = Registry("sampler", "federate.sampler")
courses = Registry("course", "course")
behaviours = Registry("behaviour", "extensions")


def selected_behaviours(cfg) -> list[str]:
    """The behaviours a course installs: those named in `extensions`, then every registered
    behaviour whose `enabled(cfg)` says its own config keys switch it on (registration order)."""
    names: list[str] = []
    for name in cfg["extensions"]:
        enabled = getattr(behaviours.get(name), "enabled", None)
        if enabled is not None and not enabled(cfg):
            # installing it anyway would run it with its keys saying "off" (e.g. local DP noise
            # under privacy.dp.mode=none, every client an attacker of type none)
            raise ConfigError(f"extensions: '{name}' is switched on by its own config keys, which "
                              "leave it off; set them (e.g. privacy.dp.mode, attack.type, "
                              "personalization.method) instead of listing it")
        if name not in names:
            names.append(name)
    for name in behaviours.names_in_order():
        enabled = getattr(behaviours.get(name), "enabled", None)
        if enabled is not None and name not in names and enabled(cfg):
            names.append(name)
    return names
