"""Plug-in trainers and aggregators, one module per algorithm."""
from fedcore.algorithms import fedavg  # noqa: F401  (registers 'fedavg')
from fedcore.algorithms import robust, dp, personalization  # noqa: F401  (behaviour plug-ins)
from fedcore.algorithms.base import Aggregator, Algorithm, Trainer

__all__ = ["Aggregator", "Algorithm", "Trainer", "fedavg", "robust", "dp", "personalization"]
