"""FedAvg (McMahan et al., 2017): local SGD from the global model, sample-weighted averaging.

Client k runs `train.local_epochs` epochs (or `train.local_steps` steps) of the
configured optimizer on its data and sends its weights w_k and n_k; the
server sets w <- sum_k n_k w_k / sum_k n_k. Both halves are the base classes.
"""
from __future__ import annotations

from fedcore.kernel.contract import Aggregator, Algorithm, Trainer
from fedcore.kernel.registry import algorithms

__all__ = ["FedAvgTrainer", "FedAvgAggregator", "FEDAVG"]


class FedAvgTrainer(Trainer):
    """Local training with the configured optimizer; sends weights and sample count."""


class FedAvgAggregator(Aggregator):
    """Sample-weighted average of the received weights."""


FEDAVG = algorithms.register("fedavg", Algorithm(FedAvgTrainer, FedAvgAggregator))
