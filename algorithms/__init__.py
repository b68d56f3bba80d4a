"""Plug-in trainers and aggregators, one module per algorithm."""
from fedcore.algorithms import diloco, fedavg, feddyn, fedmos, fedprox, moon, scaffold  # noqa: F401
from fedcore.algorithms import dp, personalization, robust  # noqa: F401  (behaviour plug-ins)
from fedcore.algorithms.base import Aggregator, Algorithm, Trainer

__all__ = ["Aggregator", "Algorithm", "Trainer", "diloco", "dp", "fedavg", "feddyn", "fedmos", "fedprox",
           "moon", "personalization", "robust", "scaffold"]
