"""The default <event, handler> sets. Each module registers handlers on worker roles."""
from fedcore.handlers import asyn, evaluation, join, rounds, sync, training  # noqa: F401

__all__ = ["asyn", "evaluation", "join", "rounds", "sync", "training"]
