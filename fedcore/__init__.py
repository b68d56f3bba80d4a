"""fedcore: an event-driven, message-passing federated-learning runtime.

Workers (one server, many clients) register `<event, handler>` pairs on a
discrete-event scheduler; trainers and aggregators plug in by name.

From Python: `fedcore.run(cfg_or_path, **overrides)` runs a simulated course and
returns a `fedcore.api.RunResult`; `fedcore.configure(...)` builds a validated
config without running it. Both import torch only when called, so importing
fedcore (and its torch-free wire) stays light.
"""
__version__ = "0.1.0"

__all__ = ["run", "configure", "__version__"]


def run(cfg_or_path=None, /, **kwargs):
    """Run a simulated course; see `fedcore.api.run`."""
    from fedcore.api import run as _run
    return _run(cfg_or_path, **kwargs)


def configure(cfg_or_path=None, /, **overrides):
    """A validated config from YAML paths, mappings and overrides; see `fedcore.api.configure`."""
    from fedcore.api import configure as _configure
    return _configure(cfg_or_path, **overrides)
