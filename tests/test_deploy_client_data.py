"""A client process holds only its own data: partition K as the simulation builds it, or its own root."""
import torch

from fedcore.deployment.distributed import ClientCourse, own_data_config
from fedcore.scenarios.data import build_federated_data
from fedcore.kernel.scheduler import WallClockScheduler
from tests.conftest import small_cfg


class _Comm:
    on_new_server = None

    def attach(self, worker):
        self.worker = worker


def _client(cfg, k):
    return ClientCourse(cfg, WallClockScheduler()).build(k, _Comm())


def test_client_keeps_exactly_its_simulated_partition():
    cfg = small_cfg(None, federate__mode="distributed", distribute__role="client", distribute__client_id=4)
    course = _client(cfg, 4)
    expected = build_federated_data(cfg).clients[4]
    assert list(course.data.clients) == [4] and len(course.data.server_test) == 0
    mine = course.client.data
    for split in ("train", "val", "test"):
        assert torch.equal(getattr(mine, split).x, getattr(expected, split).x)
        assert torch.equal(getattr(mine, split).y, getattr(expected, split).y)
    assert course.client_ids == [4] and course.comm.worker is course.client
    assert course.outdir is None  # a client writes no outputs


def test_own_data_uses_the_whole_local_dataset():
    cfg = small_cfg(None, federate__mode="distributed", distribute__role="client",
                    distribute__client_id=5, distribute__own_data=True, federate__sample_client_num=3)
    course = _client(cfg, 5)
    local = build_federated_data(own_data_config(cfg)).clients[1]
    assert torch.equal(course.client.data.train.x, local.train.x)
    total = sum(len(s) for s in (local.train, local.val, local.test))
    assert total == cfg["data.synthetic.samples_per_client"]  # one device's samples, all of them
