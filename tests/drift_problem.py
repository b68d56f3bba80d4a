"""A tiny full-batch linear-regression federation, and plain-numpy reference steps.

Three clients with 4, 5 and 3 points in R^2; the model is y = w.x + b in
float64; the loss is the mean squared error, so the full-batch gradient is
(2/n) A^T (A theta - y) with A = [X, 1] and theta = [w, b]. The references
below are the papers' equations written with numpy, independent of torch.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from fedcore.kernel import registry
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.scenarios.data import ClientData, Split
from fedcore.kernel.state import MemoryStateStore
from tests.conftest import small_cfg

THETA0 = np.array([0.3, -0.2, 0.1])          # [w1, w2, b]
LR = 0.05
STEPS = 3

_X = {1: [[1.0, 2.0], [0.5, -1.0], [-1.5, 0.3], [2.0, 0.1]],
      2: [[0.2, 0.4], [1.1, 1.3], [-0.7, 2.2], [0.0, -1.0], [1.5, -0.5]],
      3: [[-2.0, 1.0], [0.3, 0.3], [1.0, -2.0]]}
_Y = {1: [1.0, -0.5, 2.0, 0.3], 2: [0.0, 1.5, -1.0, 0.7, 2.2], 3: [3.0, -0.2, 1.1]}


def arrays(cid: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.array(_X[cid])
    return np.hstack([x, np.ones((len(x), 1))]), np.array(_Y[cid])


def grad(cid: int, theta: np.ndarray) -> np.ndarray:
    """Full-batch gradient of the mean squared error on client `cid`."""
    a, y = arrays(cid)
    return 2.0 / len(y) * a.T @ (a @ theta - y)


def n_samples(cid: int) -> int:
    return len(_Y[cid])


def client_data(cid: int) -> ClientData:
    x = torch.tensor(_X[cid], dtype=torch.float64)
    y = torch.tensor(_Y[cid], dtype=torch.float64)
    return ClientData(Split(x, y), Split(x[:0], y[:0]), Split(x, y))


def config(algorithm: str, **overrides):
    base = dict(algorithm__name=algorithm, model__dtype="float64", train__loss="mse",
                federate__client_num=3, train__batch_size=64, train__local_steps=STEPS,
                train__optimizer__lr=LR, data__synthetic__dim=2)
    base.update(overrides)
    return small_cfg(None, **base)


def linear_model(theta: np.ndarray = THETA0) -> nn.Module:
    model = nn.Sequential(nn.Flatten(), nn.Linear(2, 1)).double()
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor(theta[:2]).reshape(1, 2))
        model[1].bias.copy_(torch.tensor(theta[2:]))
    return model


def as_theta(state: dict) -> np.ndarray:
    """[w1, w2, b] from a state dict of the linear model (or a dict of the same keys)."""
    return np.concatenate([state["1.weight"].reshape(-1).numpy(), state["1.bias"].reshape(-1).numpy()])


def build(cfg, model: nn.Module | None = None, store=None):
    """The configured algorithm's trainer and aggregator on the linear model."""
    algorithm = registry.algorithms.get(cfg["algorithm.name"])
    model = model if model is not None else linear_model()
    trainer = algorithm.trainer(copy.deepcopy(model), cfg, store if store is not None else MemoryStateStore())
    return trainer, algorithm.aggregator(model, cfg, cfg["federate.client_num"])


def run_round(trainer, aggregator, round_: int, clients, data=client_data):
    """Broadcast, train each client, aggregate; returns (results, aggregate metrics)."""
    received = aggregator.broadcast(round_)
    results = {cid: trainer.fit(cid, data(cid), received, round_) for cid in clients}
    updates = [ReceivedUpdate(cid, r.content, round_) for cid, r in results.items()]
    aggregator.aggregate(updates, round_)
    return results
