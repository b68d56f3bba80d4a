"""Plug-in trainers and aggregators, one module per algorithm."""
from fedcore.algorithms import diloco, fedavg  # noqa: F401  (register 'diloco', 'fedavg')
from fedcore.algorithms.base import Aggregator, Algorithm, Trainer

__all__ = ["Aggregator", "Algorithm", "Trainer", "diloco", "fedavg"]
