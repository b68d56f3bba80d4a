"""The built-in data: synthetic(alpha, beta), csv with a natural client column, iid/dirichlet splits."""
import numpy as np
import pytest
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.scenarios.data import build_federated_data
from fedcore.scenarios.datasets import softmax_synthetic
from tests.conftest import small_cfg


def test_synthetic_labels_follow_the_generating_model():
    rng = np.random.default_rng(0)
    x, y, groups = softmax_synthetic(3, 1.0, 1.0, False, dim=5, num_classes=4,
                                     sizes=np.array([10, 20, 30]), rng=rng)
    assert x.shape == (60, 5) and y.shape == (60,) and set(groups) == {0, 1, 2}
    assert y.min() >= 0 and y.max() < 4
    # iid variant: one global model, so a linear model fits all devices' labels at once
    x, y, _ = softmax_synthetic(4, 0, 0, True, dim=5, num_classes=3, sizes=np.full(4, 200),
                                rng=np.random.default_rng(1))
    assert len(np.unique(y)) == 3


def test_natural_partition_gives_each_device_its_own_samples():
    cfg = small_cfg(None, federate__client_num=4, data__synthetic__samples_per_client=50)
    fed = build_federated_data(cfg)
    sizes = [len(c.train) + len(c.val) + len(c.test) for c in fed.clients.values()]
    assert sizes == [50] * 4
    assert len(fed.server_test) == sum(len(c.test) for c in fed.clients.values())
    assert fed.clients[1].train.x.dtype == torch.float32


def test_float64_casts_the_data():
    fed = build_federated_data(small_cfg(None, model__dtype="float64"))
    assert fed.clients[1].train.x.dtype == torch.float64


def _csv(tmp_path):
    p = tmp_path / "d.csv"
    rows = ["f1,f2,label,site"]
    for i in range(30):
        rows.append(f"{i},{i % 3},{'yes' if i % 2 else 'no'},site{i % 3}")
    p.write_text("\n".join(rows) + "\n")
    return p


def test_csv_natural_partition_by_client_column(tmp_path):
    cfg = small_cfg(None, data__type="csv", data__root=str(_csv(tmp_path)), data__client_column="site",
                    data__partition="natural", federate__client_num=3, data__splits=[1.0, 0.0, 0.0],
                    data__test_size=0.0)
    fed = build_federated_data(cfg)
    assert fed.num_classes == 2 and fed.input_shape == (2,)
    for cid in (1, 2, 3):
        x = fed.clients[cid].train.x
        assert len(x) == 10 and torch.all(x[:, 1] == cid - 1)  # site k holds the rows with f2 == k
        assert torch.equal(fed.clients[cid].train.y, (x[:, 0] % 2).long())


def test_csv_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_federated_data(small_cfg(None, data__type="csv", data__root=str(tmp_path / "x.csv"),
                                       data__partition="iid"))
    with pytest.raises(ConfigError, match="column 'lbl'"):
        build_federated_data(small_cfg(None, data__type="csv", data__root=str(_csv(tmp_path)),
                                       data__label_column="lbl", data__partition="iid"))


def _label_entropy(fed):
    ents = []
    for c in fed.clients.values():
        y = torch.cat([c.train.y, c.val.y, c.test.y])
        p = torch.bincount(y, minlength=fed.num_classes).double() / len(y)
        p = p[p > 0]
        ents.append(float(-(p * p.log()).sum()))
    return float(np.mean(ents))


def test_iid_and_dirichlet_partitions():
    common = dict(federate__client_num=10, data__synthetic__samples_per_client=100,
                  data__synthetic__iid=True)
    iid = build_federated_data(small_cfg(None, data__partition="iid", **common))
    total = sum(len(c.train) + len(c.val) + len(c.test) for c in iid.clients.values())
    assert total == 1000
    skewed = build_federated_data(small_cfg(None, data__partition="dirichlet", data__alpha=0.05,
                                            data__min_size=5, **common))
    mild = build_federated_data(small_cfg(None, data__partition="dirichlet", data__alpha=100.0, **common))
    assert all(len(c.train) + len(c.val) + len(c.test) >= 5 for c in skewed.clients.values())
    assert _label_entropy(skewed) < _label_entropy(mild) - 0.3
    again = build_federated_data(small_cfg(None, data__partition="dirichlet", data__alpha=0.05,
                                           data__min_size=5, **common))
    assert all(torch.equal(again.clients[k].train.y, skewed.clients[k].train.y) for k in skewed.clients)
