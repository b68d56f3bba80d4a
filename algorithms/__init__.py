"""Plug-in trainers and aggregators, one module per algorithm."""
from fedcore.algorithms import diloco, fedavg  # noqa: F401  (register algorithms)
from fedcore.algorithms import dp, personalization, robust  # noqa: F401  (behaviour plug-ins)
from fedcore.algorithms.base import Aggregator, Algorithm, Trainer

__all__ = ["Aggregator", "Algorithm", "Trainer", "diloco", "dp", "fedavg", "personalization", "robust"]
