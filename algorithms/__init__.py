"""Plug-in trainers and aggregators, one module per algorithm."""
from fedcore.algorithms import (analytics, diloco, fedasync, fedavg, fedbuff, feddyn, fedmos, fednova,  # noqa: F401
                                fedprox, moon, scaffold, staleness, trees)
# lora first: its exact combination of adapters is the innermost, so DP's accounting sees every update
from fedcore.algorithms import lora  # noqa: F401
from fedcore.algorithms import dp, local_budget, personalization, robust  # noqa: F401  (behaviour plug-ins)
from fedcore.algorithms import dp_ftrl  # noqa: F401  (central DP's other mechanism, after dp)
from fedcore.algorithms import compression, streaming  # noqa: F401  (after the behaviours that change the update)
from fedcore.algorithms import fedrep, pfedme  # noqa: F401  (after the behaviours, whose order they keep)
from fedcore.algorithms import fedex  # noqa: F401  (last: it wraps what the others installed)
from fedcore.algorithms import splitnn, vertical_lr  # noqa: F401  (vertical courses; PSI and Paillier load on use)
from fedcore.kernel.contract import Aggregator, Algorithm, Trainer

__all__ = ["Aggregator", "Algorithm", "Trainer", "analytics", "compression", "diloco", "dp", "dp_ftrl", "fedasync", "fedavg",
           "fedbuff", "fedex",
           "feddyn", "fedmos", "fednova", "fedprox", "fedrep", "local_budget", "lora", "moon", "personalization",
           "pfedme", "robust", "scaffold", "splitnn", "staleness", "streaming", "trees", "vertical_lr"]
