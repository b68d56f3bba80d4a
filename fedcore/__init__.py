"""fedcore: an event-driven, message-passing federated-learning runtime.

Workers (one server, many clients) register `<event, handler>` pairs on a
discrete-event scheduler; trainers and aggregators plug in by name.

From Python: `fedcore.run(cfg_or_path, **overrides)` runs a simulated course and
returns a `RunResult`; `fedcore.config(...)` builds a validated config (see
fedcore.api). Both import torch only when called, so the wire stays torch-free.
"""
__version__ = "0.1.0"

__all__ = ["run", "config", "__version__"]


def run(cfg_or_path=None, /, **kwargs):
    """Run a simulated course; see `fedcore.api.run`."""
    from fedcore.api import run as _run
    return _run(cfg_or_path, **kwargs)


def config(cfg_or_path=None, /, **overrides):
    """A validated config from YAML paths, mappings and overrides; see `fedcore.api.config`."""
    from fedcore.api import config as _config
    return _config(cfg_or_path, **overrides)
