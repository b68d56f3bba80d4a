"""The default <event, handler> sets. Each module registers handlers on worker roles."""
from fedcore.handlers import evaluation, join, rounds, sync, training  # noqa: F401
from fedcore.handlers import attack  # noqa: F401  (participant plug-in: malicious clients)

__all__ = ["evaluation", "join", "rounds", "sync", "training", "attack"]
