"""A simulation's memory (`aggregator.spill`): a folding round keeps the global model, its
float64 running sum and a server optimizer's moments in unlinked private files while the
clients train; the results are those of the rounds held in memory bit for bit, the files
have no name and go with the round, and what the process holds does not grow with the
clients per round."""
import ctypes
import gc
import json
import os

import pytest
import torch

from fedcore.algorithms import streaming
from fedcore.algorithms.streaming import FoldingBuffer, RunningMean
from fedcore.execution import executor
from fedcore.kernel import contract
from fedcore.runtime import server_optimizer
from fedcore.runtime.course import Course
from fedcore.wire.spooled import blank, copy_released, is_mapped, mapped_bytes, park
from tests.conftest import small_cfg

# an MLP 64 -> 8192 -> 3: its first weight (2 MiB) is parked (runtime/parking.py PARKED_TENSOR_BYTES)
LARGE = dict(model__type="mlp", model__hidden=[8192], data__synthetic__dim=64, federate__client_num=8,
             federate__total_round_num=3, aggregator__streaming="on")
MODEL_BYTES = (64 * 8192 + 8192 + 3 * 8192 + 3) * 4


def _course(tmp_path, name, **kw):
    course = Course(small_cfg(tmp_path / name, **{**LARGE, **kw}))
    course.run()
    return course


def _records(path):
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    for r in rows:
        r.pop("wall_time", None)
    return rows


@pytest.mark.parametrize("algorithm", [
    {},
    {"server_optimizer__type": "adam"},
    {"server_optimizer__type": "yogi", "federate__sample_client_num": 3},
    {"algorithm__name": "fedprox", "server_optimizer__type": "sgdm"},
    {"aggregator__streaming_sum": "model"},
    {"algorithm__name": "scaffold"},
    {"executor": "vectorized", "server_optimizer__type": "adam"},
])
def test_a_spilled_course_equals_the_one_held_in_memory_bit_for_bit(tmp_path, monkeypatch, algorithm):
    # bands of 2^16 values: the server optimizer steps the first weight band by band, into files
    monkeypatch.setattr(server_optimizer, "BAND", 2 ** 16)
    held = _course(tmp_path, "held", aggregator__spill="off", **algorithm)
    spilled = _course(tmp_path, "spilled", aggregator__spill="on", **algorithm)
    assert isinstance(spilled.server.buffer, FoldingBuffer) and spilled.server.buffer.running.spill
    assert not held.server.buffer.running.spill
    # the round's mean, and a server optimizer's step from it, were written into files (SCAFFOLD:
    # x + eta_g mean(dy_i) into its mean's, c + sum(dc_i) / N into its sum's)
    assert is_mapped(spilled.server.aggregator.global_state["1.weight"])
    assert all(is_mapped(c) for c in getattr(spilled.server.aggregator, "control", {}).values())
    assert not is_mapped(held.server.aggregator.global_state["1.weight"])
    for name, t in held.server.aggregator.global_state.items():
        assert torch.equal(spilled.server.aggregator.global_state[name], t), name
    for name, c in getattr(held.server.aggregator, "control", {}).items():   # SCAFFOLD's c
        assert torch.equal(spilled.server.aggregator.control[name], c), name
    assert _records(tmp_path / "spilled") == _records(tmp_path / "held")


def test_a_spilled_running_sum_is_the_one_in_memory_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "SUM_PIECE", 7)     # pieces and slices straddle each other
    monkeypatch.setattr(streaming, "FOLD_STEP", 3)
    g = torch.Generator().manual_seed(2)
    models = [{"w": torch.randn(6, 5, generator=g), "n": torch.randint(0, 9, (4,), generator=g)} for _ in range(5)]
    weights = [0.0, 3.0, 1.0, 0.0, 7.0]               # zero weights first: the sum restarts at the first positive
    sums = []
    for spill in (False, True):
        running = RunningMean(spill=spill, folder=str(tmp_path))
        for m, w in zip(models, weights):
            running.fold(m, w)
        assert all(is_mapped(p) == spill for pieces in running.sum.values() for p in pieces)
        sums.append(running.mean())
    assert all(torch.equal(sums[0][n], sums[1][n]) for n in sums[0])
    assert os.listdir(tmp_path) == []                  # the file never had a name


def _spilled_files(folder):
    """(mode, link count) of each file of `folder` this process maps."""
    out = {}
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder) + "/"):
            st = os.stat(f"/proc/self/map_files/{fields[0]}")
            out[fields[4]] = (st.st_mode & 0o777, st.st_nlink)
    return out


def test_the_spilled_files_are_private_nameless_and_go_with_their_round(tmp_path, monkeypatch):
    seen = []
    fit = contract.Trainer.fit

    def watched(self, *args):
        seen.append(_spilled_files(tmp_path / "spilled"))   # as the clients train
        return fit(self, *args)
    monkeypatch.setattr(contract.Trainer, "fit", watched)
    course = _course(tmp_path, "spilled", aggregator__spill="on")
    assert len(seen) == 3 * 8
    rounds = [seen[r * 8:(r + 1) * 8] for r in range(3)]
    for files in rounds:
        # the parked global model and the running sum: two files, owner-only, with no name
        assert all(len(f) == 2 for f in files[1:]) and all(f == files[-1] for f in files[1:])
        assert all(v == (0o600, 0) for f in files for v in f.values())
        # as a round's first client trains, only its parked model: the last round's files went
        assert len(files[0]) == 1
    names = set(os.listdir(tmp_path / "spilled"))
    assert names == set(os.listdir(_course(tmp_path, "held", aggregator__spill="off").outdir))
    del course
    gc.collect()
    assert _spilled_files(tmp_path / "spilled") == {}


def _resident() -> int:
    """This process's resident bytes once the C library has handed its freed heap back
    (`malloc_trim`): what it holds, in memory or mapped from a file, not what its allocator
    keeps for later."""
    _LIBC.malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _most_resident(tmp_path, monkeypatch, name, **kw):
    """The most resident at any client's fold or at a round's mean, over the built course
    (its data, the global model and the trainer's working copy), in models."""
    peaks = []
    for cls, method in ((FoldingBuffer, "fold_sent"), (RunningMean, "mean")):
        original = getattr(cls, method)

        def watched(self, *args, _original=original, **kw):
            out = _original(self, *args, **kw)
            peaks.append(_resident())
            return out
        monkeypatch.setattr(cls, method, watched)
    course = Course(small_cfg(tmp_path / name, **{**LARGE, **BIG, **kw})).build()
    gc.collect()
    built = _resident()
    course.run()
    return (max(peaks) - built) / BIG_BYTES


try:
    _LIBC = ctypes.CDLL(None)
    _LIBC.malloc_trim
except (OSError, AttributeError):
    _LIBC = None
BIG = dict(model__hidden=[16384])                  # a model of 4.5 MB: a Python object's bytes are noise
BIG_BYTES = (64 * 16384 + 16384 + 3 * 16384 + 3) * 4


@pytest.mark.skipif(_LIBC is None or not os.path.exists("/proc/self/status"),
                    reason="needs Linux's /proc and glibc's malloc_trim")
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_what_a_simulation_holds_does_not_grow_with_the_clients_per_round(tmp_path, monkeypatch, optimizer):
    monkeypatch.setattr(server_optimizer, "BAND", 2 ** 18)
    kw = {"server_optimizer__type": optimizer, "federate__total_round_num": 2}
    most = {}
    # the first course in a process also loads what any course needs once (kernels, modules)
    for name, k, spill in (("warm", 2, "on"), ("two", 2, "on"), ("eight", 8, "on"), ("held", 8, "off")):
        with monkeypatch.context() as m:
            most[name] = _most_resident(tmp_path, m, name, federate__sample_client_num=k,
                                        aggregator__spill=spill, **kw)
    # spilled: the update being folded (or nothing, at the mean) where the built course held
    # the global model, whatever the clients per round
    assert most["eight"] <= 0.25 and abs(most["eight"] - most["two"]) <= 0.25, most
    # held in memory: the float64 sum (two models) and the update beside the global model
    assert most["held"] >= most["eight"] + 2.5, most


def test_a_parked_model_is_copied_into_a_working_copy_a_slice_at_a_time(tmp_path, monkeypatch):
    from fedcore.wire import spooled
    monkeypatch.setattr(spooled, "COPY_STEP", 4096)
    released = []
    release = spooled.release
    monkeypatch.setattr(spooled, "release", lambda t: (released.append(t.numel()), release(t)))
    source = torch.randn(300, 17)
    parked = park({"w": source}, str(tmp_path))["w"]
    target = torch.empty(300, 17)
    copy_released(target, parked)
    assert torch.equal(target, source)
    assert released == [1024] * (300 * 17 // 1024) + [300 * 17 % 1024]   # 4096 bytes of float32 each
    held = torch.empty(300, 17)
    copy_released(held, source)                     # memory: one copy, nothing to release
    assert torch.equal(held, source) and len(released) == 5
    zeros = blank({"a": ((3, 4), torch.float64)}, str(tmp_path))["a"]
    assert is_mapped(zeros) and torch.equal(zeros, torch.zeros(3, 4, dtype=torch.float64))
    del parked, zeros
    gc.collect()
    assert mapped_bytes() == 0


def test_a_steps_flop_are_counted_on_the_meta_device_as_on_the_models_own():
    course = Course(small_cfg(None, torch_threads=1, model__type="mlp", model__hidden=[32, 16])).build()
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))
    x = course.data.clients[min(course.client_ids)].train.x
    for model, batch in ((course.trainer.model, torch.zeros((10,) + tuple(x.shape[1:]), dtype=x.dtype)),
                         (conv, torch.zeros(10, 1, 8, 8))):
        model.eval()
        on_meta = executor._count_step(model, batch.to("meta"), meta=True)
        assert all(p.grad is None for p in model.parameters())   # the model took no gradient
        assert on_meta == executor._count_step(model, batch, meta=False) > 0
        model.zero_grad(set_to_none=True)
    course.trainer.model.train()
    assert executor.step_mflop(course) == executor._count_step(
        course.trainer.model, torch.zeros((10,) + tuple(x.shape[1:]), dtype=x.dtype, device="meta"), meta=True)


def test_a_folder_that_cannot_take_the_files_leaves_the_round_in_memory(tmp_path, caplog):
    from fedcore.runtime.parking import Parking
    course = Course(small_cfg(tmp_path / "gone", **{**LARGE, "aggregator__spill": "on"})).build()
    course.server.state(Parking).folder = str(tmp_path / "no such folder")
    course.run()
    held = _course(tmp_path, "held", aggregator__spill="off")
    # said once, naming the key, and the course went on in memory
    assert caplog.text.count("aggregator.spill: the global model could not be kept in a file") == 1
    assert not course.server.buffer.running.spill
    assert not any(is_mapped(t) for t in course.server.aggregator.global_state.values())
    for name, t in held.server.aggregator.global_state.items():
        assert torch.equal(course.server.aggregator.global_state[name], t), name


def test_the_vectorized_executor_trains_and_folds_a_batch_of_clients_at_a_time(tmp_path, monkeypatch):
    from fedcore.execution import batching
    sizes, waiting = [], []
    compute = batching.BatchingTrainer._compute

    def watched(self, batch, key, first):
        before = len(batch.tried)
        compute(self, batch, key, first)
        sizes.append(len(batch.tried) - before)
        waiting.append(len(self._ready))      # results computed, not yet picked up by a delivery
    monkeypatch.setattr(batching.BatchingTrainer, "_compute", watched)
    kw = dict(executor="vectorized", federate__total_round_num=2)
    three = _course(tmp_path, "three", executor__batch_clients=3, **kw)
    assert sizes == [3, 3, 2] * 2 and max(waiting) == 3     # 8 clients a round: 3, 3 and 2
    assert three.trainer.batched_fits == 16 and three.trainer.sequential_fits == 0
    sizes.clear()
    waiting.clear()
    whole = _course(tmp_path, "whole", **kw)
    assert sizes == [8, 8] and max(waiting) == 8
    for name, t in whole.server.aggregator.global_state.items():   # each client's training is its own
        assert torch.allclose(three.server.aggregator.global_state[name], t, rtol=1e-6, atol=1e-7), name


def test_spilled_scaffold_keeps_its_control_variates_and_update_in_files_bit_for_bit(tmp_path, monkeypatch):
    from fedcore.algorithms import scaffold, scaffold_spill
    monkeypatch.setattr(scaffold_spill, "STEP", 1000)   # slices straddle every tensor's end
    seen = []
    adjust = scaffold.ScaffoldTrainer.adjust_gradients

    def watched(self):
        # as a client trains: c - c_i in a file, and c_i (after its first round) in its state's file
        seen.append((all(is_mapped(t) for t in self._spilled["corr"].values()), self._correction,
                     self._spilled["c_i"] is None or all(is_mapped(t) for t in self._spilled["c_i"].values())))
        return adjust(self)
    monkeypatch.setattr(scaffold.ScaffoldTrainer, "adjust_gradients", watched)
    kw = dict(algorithm__name="scaffold", algorithm__scaffold__global_lr=0.7, train__local_steps=2,
              federate__sample_client_num=5)
    spilled = _course(tmp_path, "spilled", aggregator__spill="on", **kw)
    assert seen and all(s == (True, [], True) for s in seen)
    monkeypatch.setattr(scaffold.ScaffoldTrainer, "adjust_gradients", adjust)
    held = _course(tmp_path, "held", aggregator__spill="off", **kw)
    # the list's course in memory (the updates' mean and sum taken from a list, not folded)
    listed = _course(tmp_path, "listed", aggregator__spill="off", aggregator__streaming="off", **kw)
    for name, t in held.server.aggregator.global_state.items():
        assert torch.equal(spilled.server.aggregator.global_state[name], t), name
        # the list sums in float32, the fold in float64: float32 rounding apart
        assert torch.allclose(listed.server.aggregator.global_state[name], t, rtol=1e-5, atol=1e-6), name
    for name, c in held.server.aggregator.control.items():
        assert torch.equal(spilled.server.aggregator.control[name], c), name
        assert is_mapped(spilled.server.aggregator.control[name]) and c.abs().max() > 0
    # each client's c_i+ as the course in memory made it, kept in its state as a tensor of its own
    for cid in range(1, 9):
        a, b = spilled.trainer.store.load(cid).get("c_i"), held.trainer.store.load(cid).get("c_i")
        assert (a is None) == (b is None)
        assert a is None or all(torch.equal(a[n], b[n]) and not is_mapped(a[n]) for n in b)
    assert _records(tmp_path / "spilled") == _records(tmp_path / "held")


def test_the_disk_state_store_keeps_a_large_state_without_copies_of_it(tmp_path, monkeypatch):
    from fedcore.kernel import state as state_mod
    from fedcore.wire.serialization import WireError
    g = torch.Generator().manual_seed(3)
    big = {"c_i": {"w": torch.randn(700, 1000, generator=g), "b": torch.randn(3, generator=g)},
           "sampler": {"epoch": 2, "offset": 5}}
    store = state_mod.DiskStateStore(str(tmp_path / "s"))
    monkeypatch.setattr(state_mod.DiskStateStore, "COPY_PIECE", 4096 + 7)   # records straddle pieces
    monkeypatch.setattr(state_mod.DiskStateStore, "COMPACT_MIN_BYTES", 1)
    for cid in (1, 2, 1, 2, 1):   # superseded records: the log is compacted on the way
        store.save(cid, big)
    assert store._end < 3 * 2.9e6   # two live records, garbage compacted away
    for s in (store, state_mod.DiskStateStore(str(tmp_path / "s"))):   # as kept, and as a restart reads it
        for cid in (1, 2):
            got = s.load(cid)
            assert got["sampler"] == {"epoch": 2, "offset": 5}
            assert all(torch.equal(got["c_i"][n], t) for n, t in big["c_i"].items())
    # the large record's tensor views the one buffer it was read into (not a parsed copy)
    loaded = store.load(1)["c_i"]["w"]
    assert loaded.untyped_storage().nbytes() >= loaded.numel() * 4 > 0
    assert loaded.untyped_storage().data_ptr() <= loaded.data_ptr() < loaded.untyped_storage().data_ptr() + 4096
    # a damaged large record is said, naming the client, not decoded into something else
    body, n = store._where[1]
    with open(tmp_path / "s" / state_mod._LOG, "r+b") as f:   # the store's own descriptor appends
        f.seek(body + n // 2)
        f.write(b"\xff" * 16)
    with pytest.raises(WireError, match="client 1 is damaged"):
        store.load(1)


def test_a_folding_scaffold_rounds_snapshot_keeps_c_by_reference_and_puts_it_back(tmp_path):
    from fedcore.runtime.admission import Snapshot
    course = Course(small_cfg(tmp_path / "c", **{**LARGE, "algorithm__name": "scaffold",
                                                 "aggregator__spill": "off"})).build()
    agg = course.server.aggregator
    before = {n: c.clone() for n, c in agg.control.items()}
    snap = Snapshot(agg, copy=False)
    assert all(snap.extra["control"][n] is agg.control[n] for n in agg.control)   # not cloned
    g = torch.Generator().manual_seed(1)
    one = contract.ReceivedUpdate(1, {"delta": {k: torch.randn(t.shape, generator=g) if t.is_floating_point()
                                                else torch.zeros_like(t) for k, t in agg.global_state.items()},
                                      "delta_control": {n: torch.randn(c.shape, generator=g) for n, c in before.items()},
                                      "num_samples": 4.0}, 0, owned=True)
    agg.aggregate([one], 1)
    assert any(not torch.equal(agg.control[n], before[n]) for n in before)
    snap.restore()   # a rejected round: c as it was
    assert all(torch.equal(agg.control[n], before[n]) for n in before)
    # an aggregator that wrote c in place could not be put back: said, not silently wrong
    snap = Snapshot(agg, copy=False)
    next(iter(agg.control.values())).add_(1.0)
    with pytest.raises(RuntimeError, match="in place"):
        snap.restore()
