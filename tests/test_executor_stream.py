"""The batched executors hand each client's result on as it is produced: a worker process
sends each client's result as soon as that client is trained, and a result waiting for its
client's delivery in a round that spills (`aggregator.spill`) waits in a file, not in the
simulating process; the results are the sequential executor's bit for bit.

This module is also the plug-in (`plugins: [tests.test_executor_stream]`) that the pool's
workers import: algorithm `_stream_waiting` is FedAvg whose trainer, before each fit but a
worker's first, waits for the parent to have received as many results as that worker
trained before (`stream_test.marker_dir`), and says in its metrics whether it saw that."""
import logging
import os
import time

import pytest
import torch

from fedcore.algorithms.fedavg import FedAvgAggregator, FedAvgTrainer
from fedcore.execution import batching, framing, procpool
from fedcore.execution.batching import BatchingTrainer
from fedcore.kernel.config import declare
from fedcore.kernel.contract import Algorithm, FitResult
from fedcore.kernel.registry import algorithms
from fedcore.runtime.course import Course
from fedcore.wire.spooled import is_mapped
from tests.conftest import need_extra, small_cfg

declare("stream_test.marker_dir", str, None, "tests: where the parent marks the results it received")

WAIT = 60.0   # seconds a worker waits for the parent's mark before saying it did not see it


class _WaitingTrainer(FedAvgTrainer):
    """FedAvg's trainer; its k-th fit in this process (k >= 1) first waits until the parent
    has received k results (`received-<k>` in `stream_test.marker_dir`)."""

    fits = 0

    def fit(self, client_id, data, received, round_):
        k, folder = _WaitingTrainer.fits, self.cfg["stream_test.marker_dir"]
        _WaitingTrainer.fits += 1
        seen = 1.0
        if k:
            deadline = time.monotonic() + WAIT
            while not os.path.exists(os.path.join(folder, f"received-{k}")):
                if time.monotonic() > deadline:
                    seen = 0.0
                    break
                time.sleep(0.01)
        res = super().fit(client_id, data, received, round_)
        return FitResult(res.content, res.work, {**res.metrics, "saw_previous_result": seen})


algorithms.register("_stream_waiting", Algorithm(_WaitingTrainer, FedAvgAggregator))


def test_a_worker_sends_each_result_as_soon_as_its_client_is_trained(tmp_path, monkeypatch):
    """One worker trains a round's four clients; before training each but its first, it waits
    for the parent to have received the result before: with results sent at the end of the
    share, that wait would never end (the worker says so after WAIT seconds)."""
    received, metrics = [0], []
    receive = framing.receive_framed

    def marked(*args):
        body = receive(*args)
        received[0] += 1
        (tmp_path / f"received-{received[0]}").touch()
        return body
    monkeypatch.setattr(procpool, "receive_framed", marked)
    fit_many = procpool.ProcessEngine.fit_many

    def watched(self, *args):
        results = fit_many(self, *args)
        metrics.extend(out[0].metrics["saw_previous_result"] for out in results)
        return results
    monkeypatch.setattr(procpool.ProcessEngine, "fit_many", watched)
    cfg = small_cfg(tmp_path / "out", executor="processes", executor_workers=1, torch_threads=1,
                    plugins=["tests.test_executor_stream"], algorithm__name="_stream_waiting",
                    stream_test__marker_dir=str(tmp_path), federate__client_num=4)
    course = Course(cfg).build()
    course.run()
    assert isinstance(course.trainer, BatchingTrainer) and course.trainer.sequential_fits == 0
    assert metrics == [1.0] * 8 and received[0] == 8     # two rounds of four clients


# an MLP 64 -> 8192 -> 3: its first weight (2 MiB) is one of a round's large tensors
LARGE = dict(model__type="mlp", model__hidden=[8192], data__synthetic__dim=64, federate__client_num=6,
             federate__total_round_num=2, aggregator__streaming="on", aggregator__spill="on",
             torch_threads=1)


def _state(course) -> dict:
    return dict(course.server.aggregator.global_state)


@pytest.mark.parametrize("algorithm, entry", [("fedavg", "model"), ("scaffold", "delta")])
def test_a_spilled_processes_course_equals_the_sequential_one_bit_for_bit(tmp_path, monkeypatch, algorithm,
                                                                          entry):
    """Each result is received into a file and decoded in place there: its large tensors (and
    SCAFFOLD's new c_i, its state) are views of that file's mapping while they wait for their
    deliveries."""
    mapped = []
    receive = framing.receive_framed

    def watched(*args):
        body = receive(*args)
        large = [body["content"][entry]["1.weight"]]
        if algorithm == "scaffold":
            large.append(body["state"]["c_i"]["1.weight"])
        mapped.append(all(is_mapped(t) for t in large))
        return body
    monkeypatch.setattr(procpool, "receive_framed", watched)
    kw = dict(LARGE, algorithm__name=algorithm)
    seq = Course(small_cfg(tmp_path / "seq", **kw))
    seq.run()
    par = Course(small_cfg(tmp_path / "par", executor="processes", executor_workers=2, **kw))
    par.run()
    assert par.trainer.batched_fits == 12 and par.trainer.sequential_fits == 0
    assert mapped == [True] * 12
    assert par.server.buffer.running.spill
    for name, t in _state(seq).items():
        assert torch.equal(_state(par)[name], t), name
    for name, c in getattr(seq.server.aggregator, "control", {}).items():
        assert torch.equal(par.server.aggregator.control[name], c), name
    assert [r["train_loss"] for r in par.monitor.records if "train_loss" in r] == \
        [r["train_loss"] for r in seq.monitor.records if "train_loss" in r]


def test_a_processes_result_views_the_bytes_it_was_received_into():
    """Without a file, a result's content is decoded in place of the one buffer it was
    received into: its large tensors view that buffer, so the encoding is not held beside
    a decoded copy."""
    big = torch.arange(2 ** 19, dtype=torch.float32)      # 2 MiB
    out = {"content": {"model": {"w": big, "b": torch.ones(3)}, "num_samples": 7},
           "work": 3.0, "metrics": {}, "state": {}}
    header, *frames = list(framing.result_messages(dict(out)))
    head = procpool._decode(bytes(header))
    assert head["work"] == 3.0 and head["metrics"] == {}
    size = head["size"]
    assert size == sum(len(f) for f in frames) > big.numel() * 4
    body = framing.receive_framed(iter(bytes(f) for f in frames), size, False, None)
    content = body["content"]
    w = content["model"]["w"]
    assert torch.equal(w, big) and torch.equal(content["model"]["b"], torch.ones(3))
    assert content["num_samples"] == 7 and body["state"] == {}
    assert w.untyped_storage().nbytes() == size      # a view of the whole received buffer


def test_spilled_results_waiting_for_their_deliveries_are_in_files(tmp_path, monkeypatch):
    """The vectorized executor trains a batch of clients at once (executor.batch_clients):
    where the round spills, each result waits for its delivery in a file, and no more
    results wait than the batch holds."""
    waiting = []
    compute = batching.BatchingTrainer._compute

    def watched(self, batch, key, first):
        compute(self, batch, key, first)
        ready = list(self._ready.values())
        waiting.append(len(ready))
        assert ready and all(is_mapped(r.result.content["model"]["1.weight"]) for r in ready)
    monkeypatch.setattr(batching.BatchingTrainer, "_compute", watched)
    vec = Course(small_cfg(tmp_path / "vec", executor="vectorized", executor__batch_clients=4, **LARGE))
    vec.run()
    assert waiting == [4, 2] * 2
    assert vec.trainer.batched_fits == 12 and vec.trainer.sequential_fits == 0


def test_spilled_scaffold_under_the_vectorized_executor_trains_sequentially_saying_so(tmp_path, caplog):
    """SCAFFOLD's control variates kept in files (aggregator.spill) would be stacked in memory
    by a batch: the vectorized executor trains its clients one by one, says so once, and the
    course is the sequential executor's bit for bit."""
    kw = dict(LARGE, algorithm__name="scaffold")
    seq = Course(small_cfg(tmp_path / "seq", **kw))
    seq.run()
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        vec = Course(small_cfg(tmp_path / "vec", executor="vectorized", **kw))
        vec.run()
    said = [r.getMessage() for r in caplog.records if "keeps its model-sized state in files" in r.getMessage()]
    assert len(said) == 1 and "running sequentially" in said[0] and "ScaffoldTrainer" in said[0]
    assert vec.trainer.batched_fits == 0 and vec.trainer.sequential_fits == 12
    for name, t in _state(seq).items():
        assert torch.equal(_state(vec)[name], t), name
    for name, c in seq.server.aggregator.control.items():
        assert torch.equal(vec.server.aggregator.control[name], c), name


@pytest.mark.slow
def test_a_spilled_ray_course_equals_the_sequential_one_bit_for_bit(tmp_path):
    """Ray's actors stream their results too (each result's messages, an object each); where
    the round spills they are received into files (into a buffer otherwise:
    tests/test_ray_executor.py). A local Ray, ended here."""
    ray = need_extra("ray")
    kw = dict(LARGE, federate__client_num=4)
    try:
        seq = Course(small_cfg(tmp_path / "seq", **kw))
        seq.run()
        on_ray = Course(small_cfg(tmp_path / "ray", executor="ray", executor_workers=2, **kw))
        on_ray.run()
        assert on_ray.trainer.batched_fits == 8 and on_ray.trainer.sequential_fits == 0
        assert on_ray.server.buffer.running.spill
        for name, t in _state(seq).items():
            assert torch.equal(_state(on_ray)[name], t), name
    finally:
        ray.shutdown()


def test_a_result_that_cannot_go_into_a_file_is_received_into_memory_saying_so(tmp_path, caplog):
    """Where the spill folder cannot take the file, the result is received into memory, with
    the same values, and one warning (for all such results) names the key and the folder."""
    big = torch.arange(2 ** 19, dtype=torch.float64)
    header, *frames = list(framing.result_messages({"content": {"w": big}, "state": {"c_i": big + 1},
                                                    "work": 1.0, "metrics": {}}))
    size = procpool._decode(bytes(header))["size"]
    missing = str(tmp_path / "no such folder")
    with caplog.at_level(logging.WARNING, logger="fedcore.executor"):
        for _ in range(2):
            body = framing.receive_framed(iter(bytes(f) for f in frames), size, True, missing)
            assert torch.equal(body["content"]["w"], big) and torch.equal(body["state"]["c_i"], big + 1)
            assert not is_mapped(body["content"]["w"])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "aggregator.spill" in said[0] and missing in said[0]
    spilled = framing.receive_framed(iter(bytes(f) for f in frames), size, True, str(tmp_path))
    assert is_mapped(spilled["content"]["w"]) and torch.equal(spilled["state"]["c_i"], big + 1)
    assert os.listdir(tmp_path) == []      # the file never had a name
