"""`synthetic`: FedProx's synthetic(alpha, beta), one natural group per device."""
from __future__ import annotations

import numpy as np
import torch

from fedcore.kernel.config import declare, positive
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset

__all__ = ["synthetic", "softmax_synthetic"]

declare("data.synthetic.alpha", float, 0.0, "synthetic: how much local models differ across devices "
        "(u_k ~ N(0, alpha))")
declare("data.synthetic.beta", float, 0.0, "synthetic: how much local inputs differ across devices "
        "(B_k ~ N(0, beta))")
declare("data.synthetic.iid", bool, False, "synthetic: one global model and input distribution "
        "(FedProx's synthetic_iid)")
declare("data.synthetic.dim", int, 60, "synthetic: input dimension",
        check=positive)
declare("data.synthetic.num_classes", int, 10, "synthetic: number of classes",
        check=lambda v: None if v >= 2 else "must be >= 2")
declare("data.synthetic.samples_per_client", int, None, "synthetic: a fixed sample count per device "
        "(default: power law, lognormal(4, 2) + 50 as in LEAF, capped at max_samples)",
        check=positive)
declare("data.synthetic.max_samples", int, 1000, "synthetic: cap on a device's power-law sample count",
        check=positive)


def softmax_synthetic(num_devices: int, alpha: float, beta: float, iid: bool, dim: int,
                      num_classes: int, sizes: np.ndarray, rng: np.random.Generator):
    """FedProx (Li et al., 2020, Sec. 5.1): y = argmax(softmax(W_k x + b_k)).

    W_k ~ N(u_k, 1), b_k ~ N(u_k, 1), u_k ~ N(0, alpha); x_k ~ N(v_k, Sigma) with
    v_k ~ N(B_k, 1), B_k ~ N(0, beta), Sigma diagonal with Sigma_jj = j^-1.2.
    In the iid variant W, b ~ N(0, 1) are shared and v = 0 for every device.
    """
    sigma = np.array([(j + 1) ** -1.2 for j in range(dim)])
    xs, ys, groups = [], [], []
    if iid:
        w_glob = rng.normal(0, 1, (dim, num_classes))
        b_glob = rng.normal(0, 1, num_classes)
    for k in range(num_devices):
        if iid:
            w, b, v = w_glob, b_glob, np.zeros(dim)
        else:
            u = rng.normal(0, np.sqrt(alpha)) if alpha > 0 else 0.0
            big_b = rng.normal(0, np.sqrt(beta)) if beta > 0 else 0.0
            w = rng.normal(u, 1, (dim, num_classes))
            b = rng.normal(u, 1, num_classes)
            v = rng.normal(big_b, 1, dim)
        x = rng.normal(v, np.sqrt(sigma), (int(sizes[k]), dim))
        y = np.argmax(x @ w + b, axis=1)
        xs.append(x)
        ys.append(y)
        groups.append(np.full(len(y), k))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(groups)


@datasets.register("synthetic")
def synthetic(cfg) -> RawDataset:
    s = cfg.section("data.synthetic")
    n = cfg["federate.client_num"]
    rng = np.random.default_rng(cfg["seed"])
    if s["samples_per_client"] is not None:
        sizes = np.full(n, s["samples_per_client"])
    else:
        sizes = np.minimum(rng.lognormal(4, 2, n).astype(int) + 50, s["max_samples"])
    x, y, groups = softmax_synthetic(n, s["alpha"], s["beta"], s["iid"], s["dim"], s["num_classes"],
                                     sizes, rng)
    return RawDataset(torch.from_numpy(x).float(), torch.from_numpy(y).long(), s["num_classes"], groups)
