"""Plug-in trainers and aggregators, one module per algorithm."""
from fedcore.algorithms import fedavg, feddyn, fedmos, fedprox, moon, scaffold  # noqa: F401  (register)
from fedcore.algorithms.base import Aggregator, Algorithm, Trainer

__all__ = ["Aggregator", "Algorithm", "Trainer", "fedavg", "feddyn", "fedmos", "fedprox", "moon",
           "scaffold"]
