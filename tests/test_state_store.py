"""State stores: memory and disk keep per-client state identically."""
import json

import torch

from fedcore.course import Course
from fedcore.state import DiskStateStore, MemoryStateStore
from tests.conftest import small_cfg


def test_disk_store_round_trips_and_reports_its_size(tmp_path):
    store = DiskStateStore(str(tmp_path / "s"))
    state = {"c": {"w": torch.arange(4.0)}, "sampler": {"epoch": 2, "offset": 7}}
    store.save(5, state)
    assert 5 in store and 6 not in store
    back = store.load(5)
    assert torch.equal(back["c"]["w"], state["c"]["w"]) and back["sampler"] == state["sampler"]
    assert store.load(6) == {}
    assert store.disk_bytes() > 0
    store.save(5, {})
    assert 5 not in store and store.disk_bytes() == 0


def test_memory_store_forgets_empty_states():
    store = MemoryStateStore()
    store.save(1, {"x": 1})
    store.save(1, {})
    assert 1 not in store


def test_disk_and_memory_courses_agree(tmp_path):
    common = dict(federate__sample_client_num=3, federate__total_round_num=3,
                  train__optimizer__momentum=0.5, train__preserve_optimizer_state=True)
    Course(small_cfg(tmp_path / "m", **common)).run()
    Course(small_cfg(tmp_path / "d", state__store="disk", state__path=str(tmp_path / "store"), **common)).run()
    rows = {}
    for name in ("m", "d"):
        rows[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for r in rows[name]:
            r.pop("wall_time")
    assert rows["m"] == rows["d"]
    assert any((tmp_path / "store").glob("client_*.pt"))


def test_disk_store_writes_tensor_and_int_states_compactly_and_others_with_torch_save(tmp_path):
    store = DiskStateStore(str(tmp_path))
    big = torch.arange(1000.0).reshape(100, 10)
    store.save(1, {"c_i": {"w": big[3]}, "sampler": {"epoch": 1, "offset": 4}})   # a view of a row
    assert (tmp_path / "client_1.fcs").exists() and not (tmp_path / "client_1.pt").exists()
    assert store.disk_bytes() < 200          # the row's 40 bytes, not the whole 4000-byte storage
    back = store.load(1)
    assert torch.equal(back["c_i"]["w"], big[3]) and back["sampler"] == {"epoch": 1, "offset": 4}
    back["c_i"]["w"].add_(1)                 # loaded tensors are the client's own, writable
    store.save(1, {"optimizer": {"state": {0: {"momentum_buffer": torch.ones(2)}}}, "lr": 0.5})
    assert (tmp_path / "client_1.pt").exists() and not (tmp_path / "client_1.fcs").exists()
    assert store.load(1)["lr"] == 0.5 and 1 in store
    store.save(1, {})
    assert 1 not in store and store.disk_bytes() == 0


def test_damaged_compact_state_file_is_refused_by_name(tmp_path):
    import pytest
    from fedcore.serialization import WireError
    (tmp_path / "client_2.fcs").write_bytes(b"not a state")
    with pytest.raises(WireError, match="client_2.fcs"):
        DiskStateStore(str(tmp_path)).load(2)


def test_a_reopened_disk_store_finds_the_states_already_there(tmp_path):
    DiskStateStore(str(tmp_path)).save(3, {"c": {"w": torch.ones(2)}})
    DiskStateStore(str(tmp_path)).save(4, {"opt": {0: torch.ones(1)}})
    again = DiskStateStore(str(tmp_path))
    assert 3 in again and 4 in again and 5 not in again
    assert torch.equal(again.load(3)["c"]["w"], torch.ones(2))
    assert torch.equal(again.load(4)["opt"][0], torch.ones(1))
