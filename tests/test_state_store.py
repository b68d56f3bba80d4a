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
