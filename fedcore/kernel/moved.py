"""Old import paths of moved modules, kept through the deprecation policy (CHANGELOG.md).

Code written against an earlier layout (`import fedcore.worker`, `from fedcore import course`,
`python -m fedcore.key_index`) gets the moved module itself under its old name, the same
object and not a copy, with a `DeprecationWarning` naming the new path and the release in which
the old one goes. Standard library only: `fedcore/__init__.py` installs it before anything
else is imported.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings

# An old path works, with its warning, in the release that deprecates it and the next minor
# one; it is removed in this release (tests/test_moved.py fails once __version__ reaches it).
REMOVED_IN = "0.4.0"

# old name -> new name, both under `fedcore.` (the plug-in packages are fedcore.algorithms,
# fedcore.handlers and fedcore.scenarios as installed)
MOVED: dict[str, str] = {
    "admission": "runtime.admission",
    "algorithms.inner_loop": "kernel.inner_loop",
    "batch_order": "kernel.batch_order",
    "batching": "execution.batching",
    "checkpoint": "runtime.checkpoint",
    "client_conv": "execution.client_conv",
    "client_state": "comm.client_state",
    "completeness": "kernel.completeness",
    "config": "kernel.config",
    "config_keys": "kernel.config_keys",
    "contract": "kernel.contract",
    "course": "runtime.course",
    "dense_step": "execution.dense_step",
    "deploy_config": "deployment.deploy_config",
    "deployed_resume": "deployment.deployed_resume",
    "device": "runtime.device",
    "distributed": "deployment.distributed",
    "edge_process": "deployment.edge_process",
    "errors": "kernel.errors",
    "executor": "execution.executor",
    "form_boundary": "execution.form_boundary",
    "hooks": "kernel.hooks",
    "inner_loop": "kernel.inner_loop",
    "key_index": "kernel.key_index",
    "launch_guard": "deployment.launch_guard",
    "launch_tree": "deployment.launch_tree",
    "loggers": "runtime.loggers",
    "message": "kernel.message",
    "model_ops": "kernel.model_ops",
    "monitor": "runtime.monitor",
    "numpy_trainer": "execution.numpy_trainer",
    "procpool": "execution.procpool",
    "progress": "runtime.progress",
    "quiet": "runtime.quiet",
    "random_layers": "execution.random_layers",
    "ray_executor": "execution.ray_executor",
    "registry": "kernel.registry",
    "sampling": "runtime.sampling",
    "scheduler": "kernel.scheduler",
    "schema": "kernel.schema",
    "serialization": "wire.serialization",
    "server_optimizer": "runtime.server_optimizer",
    "server_state": "kernel.server_state",
    "shamir": "kernel.shamir",
    "snapshot": "runtime.snapshot",
    "speed_sampling": "runtime.speed_sampling",
    "state": "kernel.state",
    "step_graphs": "execution.step_graphs",
    "tensor_forms": "wire.tensor_forms",
    "timing": "runtime.timing",
    "topology": "runtime.topology",
    "vector_term": "kernel.vector_term",
    "vectorized": "execution.vectorized",
    "worker": "kernel.worker",
}

_IMPORT_MACHINERY = (os.path.dirname(importlib.__file__) + os.sep, "<frozen importlib", "<frozen runpy",
                     os.path.splitext(__file__)[0])


def new_path(old: str) -> str | None:
    """The full new name of the full old name `old` (`fedcore.worker`), or None if it did not move."""
    short = old.removeprefix("fedcore.")
    return f"fedcore.{MOVED[short]}" if old.startswith("fedcore.") and short in MOVED else None


def warn(old: str, new: str) -> None:
    """The deprecation warning, attributed to the code that imported the old name, so Python's
    default filters show it where that code is a script (`__main__`) or a test."""
    frame, level = sys._getframe(1), 2   # 1 is this function, 2 its caller
    while frame is not None and frame.f_code.co_filename.startswith(_IMPORT_MACHINERY):
        name = frame.f_code.co_filename   # warnings skips importlib's bootstrap without counting it
        level += not ("importlib" in name and "_bootstrap" in name)
        frame = frame.f_back
    warnings.warn(f"{old} is deprecated: import {new} instead (the old path is removed in fedcore "
                  f"{REMOVED_IN})", DeprecationWarning, stacklevel=level)


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name first and loads it as the moved module."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = new_path(name)
        if new is None:
            return None
        where = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(name, self, origin=where.origin if where else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warn(spec.name, new_path(spec.name))
        module = importlib.import_module(new_path(spec.name))
        spec.loader_state = module.__spec__   # the import system is about to replace it
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Already executed under its own name; the import system has just given it the old
        name's spec, so give it back its own (reload, pickling by spec and `-m` read it)."""
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, name: str) -> types.CodeType:
        """`python -m fedcore.<old name>` runs the moved module."""
        new = new_path(name)
        warn(name, new)
        return importlib.util.find_spec(new).loader.get_code(new)


def install() -> None:
    """Put the finder first on `sys.meta_path` (before any finder that would find a stale old
    file), once."""
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
