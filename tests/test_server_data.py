"""A deployed server builds only what it holds: its test set and each partition's size, never a
client's samples."""
import pytest
import torch

from fedcore.deployment.distributed import ServerCourse
from fedcore.kernel.registry import datasets
from fedcore.scenarios.data import RawDataset, build_federated_data, build_server_data
from tests.conftest import small_cfg


class Rows(torch.Tensor):
    """Features that count how often rows are taken out of them (each client split is one take)."""

    takes = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            Rows.takes += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def counted_rows(cfg) -> RawDataset:
    """100 samples of 2 features; x[i] = (i, -i) so that a sample's row says which one it is."""
    i = torch.arange(100, dtype=torch.float32)
    return RawDataset(torch.stack([i, -i], 1).as_subclass(Rows), torch.arange(100) % 2, 2)


def _cfg(**kw):
    # 4 clients x 25 samples (iid), split 0.8 / 0.1 / 0.1 of 25: round(20.0) = 20 train,
    # round(2.5) = 2 val (half to even), 25 - 22 = 3 test each; no official test set, so the
    # server's is the 4 x 3 = 12 samples of the clients' test splits
    return small_cfg(None, data__type="counted_rows", data__partition="iid", federate__client_num=4,
                     data__splits=[0.8, 0.1, 0.1], **kw)


@pytest.fixture(autouse=True)
def _counted_dataset():
    """Registered for this module's tests only (the key reference lists data.type's names)."""
    datasets.register("counted_rows", counted_rows)
    Rows.takes = 0
    yield
    datasets._items.pop("counted_rows")


def test_the_server_takes_only_its_test_rows_and_knows_every_partitions_size():
    data, sizes = build_server_data(_cfg())
    assert Rows.takes == 1   # the server's test set; no client's train, val or test split
    assert sizes == {1: 20, 2: 20, 3: 20, 4: 20}
    assert data.clients == {} and len(data.server_test) == 12
    Rows.takes = 0
    full = build_federated_data(_cfg())
    assert Rows.takes == 3 * 4 + 1   # what the server no longer builds: each client's three splits
    assert torch.equal(data.server_test.x, full.server_test.x)
    assert torch.equal(data.server_test.y, full.server_test.y)
    assert sizes == {cid: len(c.train) for cid, c in full.clients.items()}
    # the test rows are the clients' test rows, which no client trains on
    train_rows = {int(r) for c in full.clients.values() for r in c.train.x[:, 0]}
    assert train_rows.isdisjoint(int(r) for r in data.server_test.x[:, 0])


def test_the_deployed_server_builds_no_client_partition_and_caps_samples_at_the_largest():
    cfg = _cfg(distribute__role="server", distribute__insecure=True, distribute__server_port=0)
    course = ServerCourse(cfg, None).build()
    assert Rows.takes == 1
    assert course.data.clients == {} and len(course.data.server_test) == 12
    assert course.default_sample_cap == 20
