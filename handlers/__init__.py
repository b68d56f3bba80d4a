"""The default <event, handler> sets. Each module registers handlers on worker roles."""
from fedcore.handlers import deployment, evaluation, join, rounds, sync, training  # noqa: F401

__all__ = ["deployment", "evaluation", "join", "rounds", "sync", "training"]
