"""Sync FedAvg end to end: hand-computed aggregation, honest bytes, determinism, handler table."""
import gc
import json
import logging
import warnings

import pytest
import torch
from torch import nn

from fedcore.kernel.contract import ReceivedUpdate, weighted_mean
from fedcore.kernel.errors import ConfigError
from fedcore.algorithms.fedavg import FedAvgAggregator
from fedcore.runtime.course import Course
from fedcore.kernel.message import Message
from tests.conftest import small_cfg


def _records(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_fedavg_aggregation_matches_hand_computation():
    cfg = small_cfg()
    model = nn.Linear(2, 1)
    agg = FedAvgAggregator(model, cfg, num_clients=3)
    ups = [
        ReceivedUpdate(1, {"model": {"weight": torch.tensor([[1.0, 2.0]]), "bias": torch.tensor([0.0])},
                           "num_samples": 1}, 1),
        ReceivedUpdate(2, {"model": {"weight": torch.tensor([[3.0, -2.0]]), "bias": torch.tensor([3.0])},
                           "num_samples": 3}, 1),
    ]
    agg.aggregate(ups, 1)
    # (1*[1,2] + 3*[3,-2]) / 4 = [2.5, -1.0];  (1*0 + 3*3) / 4 = 2.25
    assert torch.allclose(agg.global_state["weight"], torch.tensor([[2.5, -1.0]]))
    assert torch.allclose(agg.global_state["bias"], torch.tensor([2.25]))


def test_integer_buffers_are_averaged_and_rounded_back():
    out = weighted_mean([torch.tensor([1, 10]), torch.tensor([2, 20])], [1.0, 2.0])
    assert out.dtype == torch.int64 and out.tolist() == [2, 17]  # 5/3 -> 2, 50/3 -> 17


def test_weighted_mean_of_rows_of_one_tensor_equals_that_of_separate_tensors(monkeypatch):
    import fedcore.kernel.model_ops as base
    stacked = torch.tensor([[[1.0, 2.0]], [[3.0, -2.0]], [[5.0, 0.5]]])   # three 1x2 updates
    rows, copies, w = list(stacked.unbind(0)), [t.clone() for t in stacked], [1.0, 3.0, 4.0]
    # (1*[1,2] + 3*[3,-2] + 4*[5,0.5]) / 8 = [30/8, -2/8]
    expected = torch.tensor([[3.75, -0.25]])
    assert torch.equal(weighted_mean(rows, w), expected)        # a view of `stacked`
    assert torch.equal(weighted_mean(copies, w), expected)      # stacked copies
    assert torch.equal(weighted_mean(rows[1:], w[1:]), weighted_mean(copies[1:], w[1:]))
    # not consecutive rows: stacked; (1*[1,2] + 4*[5,0.5]) / 5 = [4.2, 0.8]
    assert torch.allclose(weighted_mean(rows[::2], w[::2]), torch.tensor([[4.2, 0.8]]))
    monkeypatch.setattr(base, "_STACK_LIMIT", 0)                # too big to stack: one add per update
    assert torch.allclose(weighted_mean(copies, w), expected)


def test_broadcast_tensors_are_never_mutated_by_aggregation():
    cfg = small_cfg()
    agg = FedAvgAggregator(nn.Linear(2, 1), cfg, num_clients=1)
    sent = agg.broadcast(1)["model"]
    before = {k: v.clone() for k, v in sent.items()}
    agg.aggregate([ReceivedUpdate(1, {"model": {k: v + 1 for k, v in sent.items()}, "num_samples": 1}, 1)], 1)
    assert all(torch.equal(sent[k], before[k]) for k in sent)


def test_same_seed_same_metrics(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    Course(small_cfg(a, federate__sample_client_num=3, federate__total_round_num=3)).run()
    Course(small_cfg(b, federate__sample_client_num=3, federate__total_round_num=3)).run()
    ra, rb = _records(a), _records(b)
    for r in ra + rb:
        r.pop("wall_time")
    assert ra == rb
    assert torch.equal(torch.load(a / "final_model.pt", weights_only=True)["1.weight"],
                       torch.load(b / "final_model.pt", weights_only=True)["1.weight"])


def test_bytes_equal_serialized_sizes_of_every_message(tmp_path):
    course = Course(small_cfg(tmp_path, federate__sample_client_num=4, eval__clients=False)).build()
    sent: list[tuple[Message, int]] = []
    original = course.comm.send

    def spy(msg):
        sent.extend((msg, r) for r in msg.receivers)
        original(msg)
    course.comm.send = spy
    course.run()
    from fedcore.wire.serialization import encode_envelope
    up = sum(len(encode_envelope(m.msg_type, m.sender, [r], m.round, m.timestamp, m.content))
             for m, r in sent if r == 0)
    down = sum(len(encode_envelope(m.msg_type, m.sender, [r], m.round, m.timestamp, m.content))
               for m, r in sent if r != 0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bytes_up"] == up and summary["bytes_down"] == down and summary["bytes_eval"] == 0
    # per-round counts add up to the totals (join-in bytes are counted in round 1)
    recs = _records(tmp_path)
    assert sum(r["bytes_up"] for r in recs) <= up and sum(r["bytes_down"] for r in recs) <= down
    # each update carries the whole model: at least 4 clients x model bytes per round
    model_bytes = sum(t.numel() * t.element_size() for t in course.server.aggregator.global_state.values())
    assert recs[1]["bytes_up"] >= 4 * model_bytes


def test_evaluation_traffic_is_counted_apart(tmp_path):
    course = Course(small_cfg(tmp_path, federate__sample_client_num=2)).build()
    course.run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    model_bytes = sum(t.numel() * t.element_size() for t in course.server.aggregator.global_state.values())
    # every eval round sends the model to all 6 clients and gets 6 metric replies back
    assert summary["bytes_eval"] > 2 * 6 * model_bytes
    assert all("bytes_eval" in r for r in _records(tmp_path))


def test_overwriting_a_handler_warns_and_is_listed(tmp_path, caplog):
    course = Course(small_cfg(tmp_path)).build()

    def my_start_round(server, event):
        from fedcore.handlers.sync import start_round
        start_round(server, event)
    with caplog.at_level(logging.WARNING):
        course.server_table.register("all_joined_in", my_start_round, sends=("models",))
    assert any("all_joined_in" in r.message and "start_round" in r.message and "my_start_round" in r.message
               for r in caplog.records)
    course.run()
    text = (tmp_path / "handlers.txt").read_text()
    assert "all_joined_in -> tests.test_fedavg_course" in text
    assert "overwritten: all_joined_in: fedcore.handlers.sync.start_round replaced by" in text


def test_a_behaviours_declared_replacement_is_listed_without_a_warning(tmp_path, caplog):
    course = Course(small_cfg(tmp_path)).build()

    def my_start_round(server, event):
        from fedcore.handlers.sync import start_round
        start_round(server, event)
    with caplog.at_level(logging.WARNING):
        course.server_table.register("all_joined_in", my_start_round, sends=("models",), replaces=True)
    assert not any("replaced" in r.message for r in caplog.records)
    course.run()
    assert "overwritten: all_joined_in: fedcore.handlers.sync.start_round replaced by" in \
        (tmp_path / "handlers.txt").read_text()


def test_logical_clients_share_one_model():
    """1000 logical clients, 100 per round: two model instances in all (global + shared trainer)."""
    def linear_13():
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # gc.get_objects touches deprecated torch module attributes
            return [o for o in gc.get_objects() if isinstance(o, nn.Linear) and o.in_features == 13]

    earlier = linear_13()   # what tests before this one in the process left alive (held: ids stay theirs)
    cfg = small_cfg(None, federate__client_num=1000, federate__sample_client_num=100,
                    federate__total_round_num=1, data__synthetic__samples_per_client=5,
                    data__synthetic__dim=13, eval__clients=False)
    course = Course(cfg).build()
    course.run()
    layers = [o for o in linear_13() if all(o is not e for e in earlier)]
    assert len(layers) == 2
    assert {id(course.trainer.model[1]), id(course.server.model[1])} == {id(x) for x in layers}
    assert len(course.clients) == 1000 and len(course.monitor.records) == 1
    # what a FedAvg client keeps between rounds is its sampler position, not a model
    state = course.store.load(course.client_ids[0]) or course.store.load(
        next(c for c in course.client_ids if c in course.store))
    assert set(state) == {"sampler"}


def test_init_from_loads_the_initial_model(tmp_path):
    cfg = small_cfg(tmp_path / "a", federate__total_round_num=1)
    course = Course(cfg).build()
    state = {k: torch.full_like(v, 0.25) for k, v in course.server.model.state_dict().items()}
    torch.save(state, tmp_path / "init.pt")
    course2 = Course(small_cfg(tmp_path / "b", model__init_from=str(tmp_path / "init.pt"))).build()
    assert all(torch.equal(v, state[k]) for k, v in course2.server.aggregator.global_state.items())


def test_init_from_a_checkpoint_or_another_model_names_what_does_not_fit(tmp_path):
    course = Course(small_cfg(tmp_path / "a", federate__total_round_num=1, checkpoint__every=1)).build()
    course.run()
    with pytest.raises(ConfigError, match="is a course checkpoint, not a model's state_dict; continue "
                                          "that course with resume_from"):
        Course(small_cfg(None, model__init_from=str(tmp_path / "a" / "checkpoints" / "round_1.pt"))).build()
    state = course.server.model.state_dict()
    other = {"extra.weight": torch.zeros(2), **{k: torch.zeros(3, *v.shape) for k, v in state.items()}}
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(ConfigError) as info:
        Course(small_cfg(None, model__init_from=str(tmp_path / "other.pt"))).build()
    names = ", ".join(list(state)[:3])
    assert str(info.value).endswith(f"does not fit model.type (unexpected extra.weight; of another shape {names})")


def test_the_run_tunes_the_garbage_collector_and_puts_it_back():
    """While a course runs, what it built is frozen and young objects are collected in larger
    batches; afterwards the process's own settings are back (it may be a user's notebook)."""
    from fedcore.runtime.monitor import Callback

    seen = {}

    class Watch(Callback):
        def on_record(self, record):
            seen.setdefault("during", (gc.get_threshold(), gc.get_freeze_count() > 0))

    before = gc.get_threshold()
    frozen_before = gc.get_freeze_count() > 0   # a test before this one may have frozen objects
    gc.unfreeze()
    gc.set_threshold(555, 11, 12)
    try:
        cfg = small_cfg(None, federate__total_round_num=1)
        Course(cfg, callbacks=[Watch()]).build().run()
        assert seen["during"][0] == (100_000, 11, 12) and seen["during"][1]
        assert gc.get_threshold() == (555, 11, 12) and gc.get_freeze_count() == 0
        # a process that froze objects of its own keeps its freeze
        gc.freeze()
        Course(small_cfg(None, federate__total_round_num=1)).build().run()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
        if frozen_before:
            gc.freeze()


@pytest.mark.parametrize("over, fragment", [
    (dict(model__type="char_lstm"), "model.type: char_lstm cannot read data.type synthetic (samples [8] of "
                                    "float32, labels [] of int64): RuntimeError: Expected tensor for argument #1 'indices'"),
    (dict(data__type="python_text", model__type="logreg"),
     "model.type: logreg cannot read data.type python_text (samples [32] of int64, labels [] of int64): "
     "RuntimeError: mat1 and mat2 must have the same dtype"),
])
def test_a_model_that_cannot_read_the_data_is_refused_when_built(over, fragment):
    with pytest.raises(ConfigError) as info:
        Course(small_cfg(None, **over)).build()
    assert str(info.value).startswith(fragment) and "\n" not in str(info.value)


def test_clients_without_training_samples_are_said_once_when_built(caplog):
    with caplog.at_level(logging.WARNING, logger="fedcore.course"):
        course = Course(small_cfg(None, data__splits=[0.0, 0.5, 0.5])).build()
    n = len(course.client_ids)
    assert caplog.text.count(f"data: {n} of {n} clients have no training samples (1, 2, 3, 4, 5, ...)") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedcore.course"):
        Course(small_cfg(None)).build()
    assert "no training samples" not in caplog.text
