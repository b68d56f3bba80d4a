"""Plug-in trainers and aggregators, one module per algorithm."""
from fedcore.algorithms import (diloco, fedasync, fedavg, fedbuff, feddyn, fedmos, fedprox,  # noqa: F401
                                moon, scaffold, staleness)
from fedcore.algorithms import dp, personalization, robust  # noqa: F401  (behaviour plug-ins)
from fedcore.algorithms import fedex  # noqa: F401  (last: it wraps what the others installed)
from fedcore.contract import Aggregator, Algorithm, Trainer

__all__ = ["Aggregator", "Algorithm", "Trainer", "diloco", "dp", "fedasync", "fedavg", "fedbuff", "fedex", "feddyn",
           "fedmos", "fedprox", "moon", "personalization", "robust", "scaffold", "staleness"]
