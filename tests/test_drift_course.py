"""Through `Course`: two rounds of each algorithm on linear regression equal the equations.

`train.loss: mse` with `model.type: logreg` is linear regression on the
synthetic data (labels as numbers); with a batch larger than every client's
data each step is full-batch, so the numpy references below (the papers'
update rules) must reproduce the final model written by the run.
"""
import numpy as np
import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg

K, LR, N = 3, 0.05, 4


def _arrays(course):
    out = {}
    for cid, data in course.data.clients.items():
        x = data.train.x.numpy()
        out[cid] = (np.hstack([x, np.ones((len(x), 1))]), data.train.y.numpy())
    return out


def _grad(a, y, theta):
    return 2.0 / len(y) * a.T @ (a @ theta - y)


def _fedprox(data, theta, rounds, mu=0.3):
    for _ in range(rounds):
        local, n = {}, {}
        for k, (a, y) in data.items():
            w = theta.copy()
            for _ in range(K):
                w = w - LR * (_grad(a, y, w) + mu * (w - theta))
            local[k], n[k] = w, len(y)
        theta = sum(n[k] * local[k] for k in data) / sum(n.values())
    return theta


def _scaffold(data, x, rounds):
    c, c_i = np.zeros_like(x), {k: np.zeros_like(x) for k in data}
    for _ in range(rounds):
        dy, dc = [], []
        for k, (a, y) in data.items():
            w = x.copy()
            for _ in range(K):
                w = w - LR * (_grad(a, y, w) + c - c_i[k])
            new = c_i[k] - c + (x - w) / (K * LR)
            dy.append(w - x)
            dc.append(new - c_i[k])
            c_i[k] = new
        x = x + np.mean(dy, axis=0)
        c = c + np.sum(dc, axis=0) / N
    return x


def _feddyn(data, theta, rounds, alpha=0.2):
    g, h = {k: np.zeros_like(theta) for k in data}, np.zeros_like(theta)
    for _ in range(rounds):
        local = {}
        for k, (a, y) in data.items():
            w = theta.copy()
            for _ in range(K):
                w = w - LR * (_grad(a, y, w) - g[k] + alpha * (w - theta))
            g[k] = g[k] - alpha * (w - theta)
            local[k] = w
        h = h - alpha * sum(local[k] - theta for k in data) / N
        theta = np.mean(list(local.values()), axis=0) - h / alpha
    return theta


def _fedmos(data, theta, rounds, mu=0.02):
    for _ in range(rounds):      # full batch: d_t is the gradient
        local, n = {}, {}
        for k, (a, y) in data.items():
            w = theta.copy()
            for _ in range(K):
                w = w - LR * _grad(a, y, w) - mu * (w - theta)
            local[k], n[k] = w, len(y)
        theta = sum(n[k] * local[k] for k in data) / sum(n.values())
    return theta


CASES = {
    "fedprox": (_fedprox, dict(algorithm__fedprox__mu=0.3)),
    "scaffold": (_scaffold, {}),
    "feddyn": (_feddyn, dict(algorithm__feddyn__alpha=0.2)),
    "fedmos": (_fedmos, dict(algorithm__fedmos__a=0.5, algorithm__fedmos__mu=0.02)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_course_two_rounds_equal_the_equations(name, tmp_path):
    reference, keys = CASES[name]
    cfg = small_cfg(tmp_path, algorithm__name=name, model__dtype="float64", train__loss="mse",
                    federate__client_num=N, train__batch_size=1000, train__local_steps=K,
                    train__optimizer__lr=LR, eval__clients=False, **keys)
    course = Course(cfg).build()
    start = course.server.aggregator.global_state
    theta0 = np.concatenate([start["1.weight"].reshape(-1).numpy(), start["1.bias"].numpy()])
    course.run()
    final = torch.load(tmp_path / "final_model.pt", weights_only=True)
    got = np.concatenate([final["1.weight"].reshape(-1).numpy(), final["1.bias"].numpy()])
    assert final["1.weight"].dtype == torch.float64
    want = reference(_arrays(course), theta0, 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.abs(want - theta0).max() > 1e-3
