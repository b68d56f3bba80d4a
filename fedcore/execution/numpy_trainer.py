"""A trainer in numpy: multinomial logistic regression, softmax cross-entropy, plain SGD.

It joins a course beside torch clients (`train.backend: numpy` on the clients
that run it). It works on numpy arrays; the runtime converts at the boundary
(`fedcore.execution.form_boundary`), and nothing here imports torch.

Alignment with the torch trainer (`model.type: logreg`, FedAvg): the model is
`nn.Sequential(Flatten, Linear)`, so the entries are `1.weight` (classes x
features) and `1.bias`. One step on a batch of B samples computes the logits
x W^T + b, the softmax p, and the gradient of the mean cross-entropy,
(p - onehot) / B, whose products with x and with ones give the gradients of W
and b; then W -= lr * dW, b -= lr * db: the arithmetic of `torch.optim.SGD`
without momentum or weight decay. The batches are the torch trainer's when
both draw them with `train.shuffle: numpy`. With `model.dtype: float64` the
two agree to rounding (about 1e-15 per step); with float32 they differ in the
order of float32 rounding. Momentum, weight decay, gradient accumulation, LR
schedules, other losses and other models are refused at config time.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedcore.kernel.batch_order import NumpyBatchStream

__all__ = ["NumpyLogRegTrainer"]

WEIGHT, BIAS = "1.weight", "1.bias"


class NumpyLogRegTrainer:
    """FedAvg's local SGD for logistic regression, in numpy (float64 or float32)."""

    tensor_form = "numpy"

    def __init__(self, initial: dict[str, np.ndarray], cfg, store):
        if set(initial) != {WEIGHT, BIAS}:
            raise ValueError(f"the numpy trainer needs a logreg model ({WEIGHT}, {BIAS}), "
                             f"got entries {sorted(initial)}")
        self.cfg, self.store = cfg, store
        self.lr = cfg["train.optimizer.lr"]
        self.batch_size = cfg["train.batch_size"]
        self.w = initial[WEIGHT].copy()
        self.b = initial[BIAS].copy()

    def num_steps(self, n_train: int) -> int:
        if self.cfg["train.local_steps"] is not None:
            return self.cfg["train.local_steps"]
        return self.cfg["train.local_epochs"] * math.ceil(n_train / self.batch_size)

    def _load(self, model: dict[str, np.ndarray]) -> None:
        self.w = np.array(model[WEIGHT], dtype=self.w.dtype)
        self.b = np.array(model[BIAS], dtype=self.b.dtype)

    def _features(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(len(x), -1).astype(self.w.dtype, copy=False)

    def _probabilities(self, x: np.ndarray) -> np.ndarray:
        z = x @ self.w.T + self.b
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One SGD step on a mini-batch; returns its mean cross-entropy (before the step)."""
        p = self._probabilities(x)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y]).mean())
        g = p
        g[np.arange(n), y] -= 1.0
        g /= n
        self.w -= self.lr * (g.T @ x)
        self.b -= self.lr * g.sum(axis=0)
        return loss

    def fit(self, client_id: int, data, received: dict, round_: int):
        from fedcore.kernel.contract import FitResult   # a plain dataclass; torch is already loaded here
        state = self.store.load(client_id)
        self._load(received["model"])
        train = data.train
        x, y = self._features(train.x), np.asarray(train.y, dtype=np.int64)
        pos = state.get("sampler", {"epoch": 0, "offset": 0})
        stream = NumpyBatchStream(len(y), self.batch_size, self.cfg["seed"], client_id,
                                  pos["epoch"], pos["offset"])
        steps = self.num_steps(len(y)) if len(y) else 0
        loss_sum, work = 0.0, 0.0
        for _ in range(steps):
            idx = stream.next()
            loss_sum += self.step(x[idx], y[idx])
            work += len(idx)
        state["sampler"] = stream.position()
        self.store.save(client_id, state)
        content = {"model": {WEIGHT: self.w.copy(), BIAS: self.b.copy()}, "num_samples": len(y)}
        return FitResult(content, work, {"train_loss": loss_sum / steps} if steps else {})

    def evaluate(self, client_id: int, data, received: dict) -> dict[str, Any]:
        self._load(received["model"])
        x, y = self._features(data.test.x), np.asarray(data.test.y, dtype=np.int64)
        if not len(y):
            return {}
        p = self._probabilities(x)
        loss = float(-np.log(p[np.arange(len(y)), y]).mean())
        return {"loss": loss, "n": len(y), "acc": float((p.argmax(1) == y).mean())}
