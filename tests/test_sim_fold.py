"""A simulation folds each update into the round's running sum as its client sends it
(streaming.fold_when_sent), so no update waits in the scheduler for its virtual arrival with
its model: the same course as folding on arrival, bit for bit where the two orders are the
same (equal clients: they arrive in the order they were sent), to float rounding otherwise."""
import json

import torch

from fedcore.algorithms.streaming import FoldingBuffer
from fedcore.kernel.message import Message
from fedcore.runtime.course import Course
from tests.conftest import small_cfg

MLP = dict(model__type="mlp", model__hidden=[16], federate__total_round_num=3,
           federate__sample_client_num=4, aggregator__streaming="on")


def _models_in_flight(course) -> int:
    """Update messages scheduled for the server that still hold a model."""
    return sum(1 for entry in course.scheduler._queue
               if isinstance(getattr(entry[3], "msg", None), Message) and entry[3].msg.msg_type == "updates"
               and isinstance(entry[3].msg.content, dict) and "model" in entry[3].msg.content)


def _course(path, at_arrival: bool = False, **overrides):
    """A built course; `at_arrival` takes the simulation's tap away, so updates fold when they
    arrive (the deployed server's way, and this project's before)."""
    course = Course(small_cfg(path, **{**MLP, **overrides})).build()
    if at_arrival:
        course.comm.taps.clear()
    in_flight = []
    # told after the folding tap: how many updates travel with their model as each is sent
    course.comm.taps.append(lambda msg, receiver: in_flight.append(_models_in_flight(course))
                            if msg.msg_type == "updates" else None)
    course.run()
    return course, in_flight


def _records(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_updates_travel_without_their_model_and_the_course_is_the_same_bit_for_bit(tmp_path):
    sent, in_flight = _course(tmp_path / "sent")
    arrived, waiting = _course(tmp_path / "arrived", at_arrival=True)
    assert isinstance(sent.server.buffer, FoldingBuffer)
    assert len(in_flight) == 3 * 4 and set(in_flight) == {0}
    # folded on arrival, a round's updates wait in the scheduler: 1, 2, 3, 4 of them as sent
    assert waiting == [1, 2, 3, 4] * 3
    for name, t in arrived.server.aggregator.global_state.items():
        assert torch.equal(sent.server.aggregator.global_state[name], t), name
    strip = ("wall_time",)
    assert ([{k: v for k, v in r.items() if k not in strip} for r in _records(tmp_path / "sent")]
            == [{k: v for k, v in r.items() if k not in strip} for r in _records(tmp_path / "arrived")])


def test_clients_arriving_in_another_order_than_they_sent_agree_to_float_rounding(tmp_path):
    # random device profiles: the round's replies arrive in another order than they were sent
    varied = dict(time__profiles={"type": "random"}, algorithm__name="fedprox",
                  server_optimizer__type="adam")
    sent, in_flight = _course(tmp_path / "sent", **varied)
    arrived, _ = _course(tmp_path / "arrived", at_arrival=True, **varied)
    listed, _ = _course(tmp_path / "listed", aggregator__streaming="off", **varied)
    assert set(in_flight) == {0}
    for name, t in arrived.server.aggregator.global_state.items():
        # float64 sums of the same terms in two orders, each cast once to float32
        assert torch.allclose(sent.server.aggregator.global_state[name], t, rtol=1e-6, atol=1e-7), name
        assert torch.allclose(sent.server.aggregator.global_state[name],
                              listed.server.aggregator.global_state[name], rtol=1e-5, atol=1e-6), name
    assert ([r["virtual_time"] for r in _records(tmp_path / "sent")]
            == [r["virtual_time"] for r in _records(tmp_path / "arrived")])
    assert ([r["bytes_up"] for r in _records(tmp_path / "sent")]
            == [r["bytes_up"] for r in _records(tmp_path / "listed")])


def test_an_observer_of_the_updates_still_sees_each_model(tmp_path):
    """Whoever watches the arriving updates gets them whole: those rounds fold on arrival."""
    course = Course(small_cfg(tmp_path, **MLP)).build()
    seen = []
    course.server_table.observe("receiving_updates", lambda server, msg: seen.append("model" in msg.content))
    course.run()
    assert len(seen) == 3 * 4 and all(seen)


def test_a_list_round_keeps_each_update_whole(tmp_path):
    course, in_flight = _course(tmp_path, aggregator__streaming="off")
    assert isinstance(course.server.buffer, list)
    assert in_flight == [1, 2, 3, 4] * 3


def test_an_update_refused_when_sent_is_refused_as_on_arrival(tmp_path):
    # clients of 54 to 197 training samples against a cap of 100: the larger ones' updates are
    # refused, the same ones whichever way the round folds
    sizes = dict(data__synthetic__samples_per_client=None, data__synthetic__max_samples=200,
                 admission__max_num_samples=100)
    sent, _ = _course(tmp_path / "sent", **sizes)
    arrived, _ = _course(tmp_path / "arrived", at_arrival=True, **sizes)
    counts = [r["num_updates"] for r in sent.monitor.records]
    assert counts == [r["num_updates"] for r in arrived.monitor.records] and min(counts) < 4
    for name, t in arrived.server.aggregator.global_state.items():
        assert torch.allclose(sent.server.aggregator.global_state[name], t, rtol=1e-6, atol=1e-7), name
