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


# Old import paths of moved modules keep working, with a DeprecationWarning naming the new one
# (fedcore/kernel/moved.py; the deprecation policy is in CHANGELOG.md).
from fedcore.kernel import moved as _moved  # noqa: E402  (standard library only)

_MOVED = _moved.MOVED
_moved.install()
