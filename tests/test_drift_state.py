"""Per-client state isolation: logical clients sharing one trainer never see each other's state.

For each stateful algorithm, one trainer serving clients 1 and 2 in turn must
produce exactly what two separate trainers (one per client) produce from the
same received content; the disk store must give the same numbers as memory.
"""
import pytest
import torch

from fedcore.kernel.state import DiskStateStore, MemoryStateStore
from tests import drift_problem as P
from tests.test_moon import _cfg as moon_cfg, _data as moon_data, _model as moon_model

CASES = {
    "scaffold": lambda: (P.config("scaffold"), None, P.client_data),
    "feddyn": lambda: (P.config("feddyn", algorithm__feddyn__alpha=0.4), None, P.client_data),
    "fedmos": lambda: (P.config("fedmos", algorithm__fedmos__a=0.3, train__batch_size=2), None,
                       P.client_data),
    "moon": lambda: (moon_cfg(), "moon", moon_data),
}


def _trainer(name, store):
    cfg, kind, _ = CASES[name]()
    model = moon_model(cfg) if kind == "moon" else None
    trainer, agg = P.build(cfg, model, store)
    return trainer, agg


def _received(agg, round_):
    """A fixed broadcast per round, with non-zero server state so client state matters."""
    content = agg.broadcast(round_)
    g = torch.Generator().manual_seed(round_)
    model = {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)
             for k, v in content["model"].items()}
    out = dict(content, model=model)
    if "control" in content:
        out["control"] = {k: 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype)
                          for k, v in content["control"].items()}
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_shared_trainer_equals_separate_trainers(name, tmp_path):
    data = CASES[name]()[2]
    shared, agg = _trainer(name, MemoryStateStore())
    alone = {1: _trainer(name, MemoryStateStore())[0], 2: _trainer(name, DiskStateStore(str(tmp_path)))[0]}
    for r in (1, 2, 3):
        received = _received(agg, r)
        for cid in (1, 2):
            a = shared.fit(cid, data(cid), received, r)
            b = alone[cid].fit(cid, data(cid), received, r)
            flat_a = _flatten(a.content)
            flat_b = _flatten(b.content)
            assert flat_a.keys() == flat_b.keys()
            for k in flat_a:
                assert torch.equal(flat_a[k], flat_b[k]), (name, r, cid, k)
            assert a.work == b.work
    # each client's own state differs from the other's (there is state to leak)
    s1, s2 = shared.store.load(1), shared.store.load(2)
    diff = [k for k in _flatten(s1) if k in _flatten(s2) and k.split("/")[0] not in ("sampler",)
            and not torch.equal(_flatten(s1)[k], _flatten(s2)[k])]
    assert diff or name == "fedmos"     # fedmos keeps nothing across rounds
    if name == "fedmos":
        assert "fedmos" not in s1 and "fedmos" not in s2


def _flatten(tree, prefix=""):
    out = {}
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}/{i}"))
    elif isinstance(tree, (int, float)):
        out[prefix] = torch.tensor(float(tree))
    return out


@pytest.mark.parametrize("name,extra", [
    ("scaffold", {}),
    ("moon", dict(model__type="moon_mlp", model__hidden=[16], model__moon__proj_dim=8)),
])
def test_disk_store_course_equals_memory_store(name, extra, tmp_path):
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg
    common = dict(algorithm__name=name, federate__sample_client_num=3, federate__total_round_num=3, **extra)
    Course(small_cfg(tmp_path / "mem", **common)).run()
    Course(small_cfg(tmp_path / "disk", state__store="disk", state__path=str(tmp_path / "state"),
                     **common)).run()
    a = torch.load(tmp_path / "mem" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "disk" / "final_model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    on_disk = DiskStateStore(str(tmp_path / "state"))           # the state really went to disk
    assert on_disk.disk_bytes() > 0 and any(cid in on_disk for cid in (1, 2, 3))
