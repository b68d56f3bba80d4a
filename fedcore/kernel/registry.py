"""Named plug-ins: a config names them, a user's module adds to them.

    from fedcore.kernel.registry import models
    @models.register("my_cnn")
    def build(cfg, spec): ...

and `plugins: [my_module]` in the YAML imports that module before the run.

The core (`fedcore` less its plug-in packages) reaches plug-in code only through these
tables: `components` holds the pieces it calls by name (the data and model builders,
the deployment's and the edge's handlers), and `load_builtin()` is the one place that
imports the built-in plug-in packages, by name, so that they register and declare
their keys (the `importlinter` contracts in setup.cfg hold the rest of the core to it).
"""
from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable

from fedcore.kernel.errors import ConfigError

__all__ = ["Registry", "algorithms", "datasets", "partitioners", "models", "samplers",
           "courses", "behaviours", "engines", "components", "selected_behaviours", "load_builtin",
           "BUILTIN_MODULES"]

# The modules that register the built-in plug-ins or declare config keys, imported by name.
BUILTIN_MODULES = (
    "fedcore.algorithms", "fedcore.runtime.checkpoint", "fedcore.runtime.device", "fedcore.deployment.distributed",
    "fedcore.execution.executor", "fedcore.execution.vectorized", "fedcore.execution.procpool", "fedcore.execution.ray_executor",
    "fedcore.handlers", "fedcore.runtime.loggers",
    "fedcore.runtime.sampling", "fedcore.scenarios", "fedcore.kernel.schema", "fedcore.runtime.server_optimizer",
    "fedcore.runtime.speed_sampling", "fedcore.runtime.timing",
)


def load_builtin() -> None:
    """Import the built-in plug-ins and the modules that declare keys (once; cheap after)."""
    for name in BUILTIN_MODULES:
        importlib.import_module(name)


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
        if name not in self._items:
            load_builtin()   # a built-in registers when its package is imported
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
engines = Registry("executor", "executor")   # what trains a broadcast's clients together
# Plug-in code the core calls by name: "federated_data", "server_data", "client_data" (the data
# a simulation, a deployed server and one deployed client build), "model", "deployment" and
# "edge" (the deployment's and the edge aggregator's handler modules), "secagg_roster" (the
# launcher's signing keys) and "fedex_local_keys" (what `fedcore.tune --method fedex` may set).
components = Registry("component", "component")


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
