"""Plug-in trainers and aggregators, one module per algorithm."""
from fedcore.algorithms import fedasync, fedavg, fedbuff, staleness  # noqa: F401  (register by name)
from fedcore.algorithms.base import Aggregator, Algorithm, Trainer

__all__ = ["Aggregator", "Algorithm", "Trainer", "fedasync", "fedavg", "fedbuff", "staleness"]
