"""State stores: memory and disk keep per-client state identically."""
import json

import torch

from fedcore.runtime.course import Course
from fedcore.kernel.state import DiskStateStore, MemoryStateStore
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


def test_disk_store_logs_tensor_and_int_states_and_torch_saves_others(tmp_path):
    store = DiskStateStore(str(tmp_path))
    big = torch.arange(1000.0).reshape(100, 10)
    store.save(1, {"c_i": {"w": big[3]}, "sampler": {"epoch": 1, "offset": 4}})   # a view of a row
    assert (tmp_path / "states.log").exists() and not (tmp_path / "client_1.pt").exists()
    assert store.disk_bytes() < 200          # the row's 40 bytes, not the whole 4000-byte storage
    back = store.load(1)
    assert torch.equal(back["c_i"]["w"], big[3]) and back["sampler"] == {"epoch": 1, "offset": 4}
    back["c_i"]["w"].add_(1)                 # loaded tensors are the client's own, writable
    assert torch.equal(store.load(1)["c_i"]["w"], big[3])
    store.save(1, {"optimizer": {"state": {0: {"momentum_buffer": torch.ones(2)}}}, "lr": 0.5})
    assert (tmp_path / "client_1.pt").exists()
    assert store.load(1)["lr"] == 0.5 and 1 in store
    store.save(1, {"c": {"w": torch.zeros(1)}})
    assert not (tmp_path / "client_1.pt").exists() and torch.equal(store.load(1)["c"]["w"], torch.zeros(1))
    store.save(1, {})
    assert 1 not in store and store.load(1) == {}


def test_a_reopened_disk_store_finds_each_clients_newest_state(tmp_path):
    a = DiskStateStore(str(tmp_path))
    a.save(3, {"c": {"w": torch.ones(2)}})
    a.save(3, {"c": {"w": torch.full((2,), 7.0)}})
    a.save(4, {"c": {"w": torch.ones(1)}})
    a.save(4, {"opt": {0: torch.ones(1)}})     # log record, then a .pt: the .pt is newest
    a.save(5, {"c": {"w": torch.ones(1)}})
    a.save(5, {})
    a.close()
    again = DiskStateStore(str(tmp_path))
    assert 3 in again and 4 in again and 5 not in again
    assert torch.equal(again.load(3)["c"]["w"], torch.full((2,), 7.0))
    assert torch.equal(again.load(4)["opt"][0], torch.ones(1))


def test_a_record_cut_short_by_a_crash_is_dropped_and_older_states_survive(tmp_path):
    a = DiskStateStore(str(tmp_path))
    a.save(1, {"c": {"w": torch.ones(3)}})
    a.save(2, {"c": {"w": torch.ones(3)}})
    a.close()
    log = tmp_path / "states.log"
    log.write_bytes(log.read_bytes()[:-5])      # the second record torn
    again = DiskStateStore(str(tmp_path))
    assert torch.equal(again.load(1)["c"]["w"], torch.ones(3)) and 2 not in again
    again.save(2, {"c": {"w": torch.zeros(3)}})  # appends after the truncated end
    again.close()
    assert torch.equal(DiskStateStore(str(tmp_path)).load(2)["c"]["w"], torch.zeros(3))


def test_the_log_is_compacted_when_superseded_records_dominate(tmp_path, monkeypatch):
    monkeypatch.setattr(DiskStateStore, "COMPACT_MIN_BYTES", 1000)
    store = DiskStateStore(str(tmp_path))
    for r in range(50):
        for cid in (1, 2):
            store.save(cid, {"c": {"w": torch.full((20,), float(r + cid))}})
    assert store.disk_bytes() < 4 * 2 * (20 * 4 + 60)        # about two live records, not 100
    assert torch.equal(store.load(1)["c"]["w"], torch.full((20,), 50.0))
    store.close()
    assert torch.equal(DiskStateStore(str(tmp_path)).load(2)["c"]["w"], torch.full((20,), 51.0))
