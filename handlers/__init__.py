"""The default <event, handler> sets. Each module registers handlers on worker roles."""
from fedcore.handlers import evaluation, join, rounds, sync, training  # noqa: F401

__all__ = ["evaluation", "join", "rounds", "sync", "training"]
