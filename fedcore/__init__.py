"""fedcore: an event-driven, message-passing federated-learning runtime.

Workers (one server, many clients) register `<event, handler>` pairs on a
discrete-event scheduler; trainers and aggregators plug in by name.

From Python: `fedcore.run(cfg_or_path, **overrides)` runs a simulated course and
returns a `fedcore.api.RunResult`; `fedcore.configure(...)` builds a validated
config without running it. Both import torch only when called, so importing
fedcore (and its torch-free wire) stays light.
"""
import os as _os

__version__ = "0.2.0"

# gRPC writes an INFO line for every failed TLS handshake, as fast as outsiders fail them
# (2.4 MB/s of log measured): only its errors, before any module here imports it, unless
# GRPC_VERBOSITY says otherwise (it is read once, when gRPC is first imported)
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# OpenMP's idle intra-op threads spin for a peer by default; on a machine whose other work
# deschedules that peer they burn their core without finishing sooner (a 2-thread step of
# P1's CNN measured 5-10x a 1-thread step's wall time at load 11 on 2 cores, ~1x passive).
# Passive threads sleep instead. OpenMP reads it once, when torch first loads it: set here,
# before any module of fedcore imports torch, unless the environment says otherwise.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["run", "configure", "__version__"]


def run(cfg_or_path=None, /, **kwargs):
    """Run a simulated course; see `fedcore.api.run`."""
    from fedcore.api import run as _run
    return _run(cfg_or_path, **kwargs)


def configure(cfg_or_path=None, /, **overrides):
    """A validated config from YAML paths, mappings and overrides; see `fedcore.api.configure`."""
    from fedcore.api import configure as _configure
    return _configure(cfg_or_path, **overrides)


def __getattr__(name: str):
    """`fedcore.api` without importing it first (`fedcore.api.RunResult.load(outdir)`), still
    without importing torch until it is used."""
    if name == "api":
        import importlib
        return importlib.import_module("fedcore.api")
    raise AttributeError(f"module 'fedcore' has no attribute {name!r}")


# ---------------------------------------------------------------- the old module names
# The modules live in role subpackages (kernel, execution, runtime, deployment, comm, wire).
# Code written against the flat layout (`import fedcore.runtime.course`, `python -m fedcore.kernel.key_index`)
# gets the same module object under its old name, not a copy.
_MOVED = {
    "admission": "runtime.admission",
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


def _install_old_names() -> None:
    import importlib
    import importlib.abc
    import importlib.util
    import sys

    class OldName(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if not name.startswith("fedcore.") or name[8:] not in _MOVED:
                return None
            where = importlib.util.find_spec(f"fedcore.{_MOVED[name[8:]]}")
            return importlib.util.spec_from_loader(name, self, origin=where.origin)

        def create_module(self, spec):
            return importlib.import_module(f"fedcore.{_MOVED[spec.name[8:]]}")

        def exec_module(self, module):
            """Already executed under its own name."""

        def get_code(self, name):   # python -m fedcore.<old name>
            new = f"fedcore.{_MOVED[name[8:]]}"
            return importlib.util.find_spec(new).loader.get_code(new)

    sys.meta_path.insert(0, OldName())   # before any finder that would find the old file


_install_old_names()
