"""A deployed folding round keeps the idle global model in a file (runtime/parking.py): the
same values, viewed by the aggregator and the server's module, no page resident until read,
sent frame by frame with each frame's pages given back, not written twice, in memory where
the disk refuses it, never in a simulation, and a deployed course still equals its simulation."""
import json
import logging

import pytest
import torch

from fedcore.algorithms.streaming import FoldingBuffer, round_buffer
from fedcore.comm.chunking import SharedContent, chunk_frames
from fedcore.runtime.course import Course
from fedcore.runtime.parking import PARKED_TENSOR_BYTES, Parking, park_global
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire import spooled
from fedcore.wire.codec import encode_value_parts
from tests.conftest import small_cfg
from tests.deploy_helpers import FORK, mapping_rss_kib, text, wait_exit, write_cfg

MIB = 2 ** 20
HIDDEN = 17 * MIB // 4 // 69   # an MLP 64 -> HIDDEN -> 3: ~69 HIDDEN floats, above spool_bytes' 16 MiB
LARGE = dict(model__type="mlp", model__hidden=[HIDDEN], data__synthetic__dim=64,
             aggregator__streaming="on", admission__norm_ratio=float("inf"))


def _deployed_server(tmp_path):
    from fedcore.deployment.distributed import ServerCourse
    cfg = small_cfg(tmp_path, distribute__role="server", distribute__insecure=True,
                    distribute__server_host="127.0.0.1", distribute__server_port=0, **LARGE)
    server = ServerCourse(cfg).build().server
    server.buffer = round_buffer(server)
    assert isinstance(server.buffer, FoldingBuffer)
    return server


def _frames(content) -> list[bytes]:
    shared = SharedContent(encode_value_parts(content))
    parts, sha = shared.envelope(pb.Envelope(msg_type="models", sender=0, receivers=[1], round=1))
    return list(chunk_frames(parts, 1, 2 * MIB, sha=sha))


def test_a_deployed_folding_round_parks_the_global_model_where_nothing_holds_its_pages(tmp_path):
    server = _deployed_server(tmp_path)
    before = {k: v.clone() for k, v in server.aggregator.global_state.items()}
    park_global(server)
    state = server.aggregator.global_state
    large = {k for k, t in before.items() if t.numel() * t.element_size() >= PARKED_TENSOR_BYTES}
    assert large and large != set(before)            # the hidden layer's weights; the rest are small
    # written with pwrite, mapped, not read yet: none of the file's pages are in the process
    weights = max(large, key=lambda n: state[n].numel())
    assert mapping_rss_kib(state[weights].data_ptr()) <= 8
    with open("/proc/self/maps") as maps:             # the file lies in the spool folder (the outdir)
        assert any(str(tmp_path) in line for line in maps)
    for name, t in state.items():
        assert spooled.is_mapped(t) == (name in large), name
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    # the server's module views the parked tensors (a copy in it would be one more model)
    module = server.model.state_dict()
    assert all(module[n].data_ptr() == t.data_ptr() for n, t in state.items())
    # a model already parked is not written again
    pointers = {n: t.data_ptr() for n, t in state.items()}
    park_global(server)
    assert {n: t.data_ptr() for n, t in server.aggregator.global_state.items()} == pointers


def test_only_the_entries_a_round_replaces_are_parked(tmp_path):
    # `federate.share_params` exchanges the first layer only: the second layer's weights (2 MB)
    # stay on the server across rounds, and parked they would keep the whole file
    from fedcore.deployment.distributed import ServerCourse
    cfg = small_cfg(tmp_path, distribute__role="server", distribute__insecure=True,
                    distribute__server_host="127.0.0.1", distribute__server_port=0,
                    **{**LARGE, "model__hidden": [HIDDEN, 8]}, federate__share_params=["1.*"])
    server = ServerCourse(cfg).build().server
    server.buffer = round_buffer(server)
    park_global(server)
    state = server.aggregator.global_state
    assert spooled.is_mapped(state["1.weight"])
    kept = [n for n, t in state.items() if not n.startswith("1.") and t.numel() * t.element_size() >= PARKED_TENSOR_BYTES]
    assert kept and not any(spooled.is_mapped(state[n]) for n in kept)


def test_a_parked_model_is_sent_as_the_same_frames_and_its_pages_go_back(tmp_path):
    server = _deployed_server(tmp_path)
    expected = _frames({"model": {k: v.clone() for k, v in server.aggregator.global_state.items()}})
    park_global(server)
    content = server.aggregator.broadcast(1)
    weights = max(content["model"].values(), key=torch.Tensor.numel)
    assert spooled.is_mapped(weights) and weights.numel() * 4 >= 15 * MIB
    assert _frames(content) == expected
    # hashed, then framed 2 MiB at a time: at most a frame's pages (and the pages a frame's edge
    # shares with the next) stay, not the 15.8 MiB the frames read
    assert mapping_rss_kib(weights.data_ptr()) <= 2 * 1024 + 8


def test_a_disk_that_refuses_the_file_leaves_the_model_in_memory_said_once(tmp_path, monkeypatch, caplog):
    server = _deployed_server(tmp_path)

    def full_disk(self, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(spooled.Spool, "write", full_disk)
    state = dict(server.aggregator.global_state)
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        park_global(server)
        park_global(server)
    assert server.aggregator.global_state == state and all(
        server.aggregator.global_state[n] is t for n, t in state.items())
    said = [r for r in caplog.records if "could not be kept in a file" in r.getMessage()]
    assert len(said) == 1 and "No space left on device" in said[0].getMessage()
    assert server.state(Parking).min_bytes == 0


def test_a_simulation_never_parks(tmp_path):
    course = Course(small_cfg(tmp_path, federate__total_round_num=1, **LARGE))
    course.run()
    assert course.server.state(Parking).min_bytes == 0
    assert not any(spooled.is_mapped(t) for t in course.server.aggregator.global_state.values())
    assert "parked_rounds" not in course.monitor.extra_summary


@pytest.mark.slow
def test_a_deployed_course_that_parks_its_model_equals_the_simulation(tmp_path, procs):
    # two clients: the float64 running sum adds two products to zero, exactly in either order,
    # so the deployed model (parked every round, then folded) is the simulation's bit for bit
    extra = {k.replace("__", "."): v for k, v in LARGE.items()}
    extra.update({"federate.client_num": 2, "eval.clients": False, "distribute.token": "t",
                  "distribute.insecure": True})
    cfg = write_cfg(tmp_path / "course.yaml", extra)
    out = tmp_path / "deployed"
    launcher = procs.start("launch", ["-m", "fedcore.launch", *FORK, "--cfg", str(cfg), "--clients", "2",
                                      f"outdir={out}"])
    assert wait_exit(launcher, 300) == 0, text(launcher)[-3000:]
    assert "could not be kept in a file" not in text(launcher)
    assert json.loads((out / "summary.json").read_text())["parked_rounds"] == 2   # each round's model
    sim_dir = tmp_path / "simulated"
    Course(small_cfg(sim_dir, federate__client_num=2, eval__clients=False, **LARGE)).run()
    deployed = torch.load(out / "final_model.pt", weights_only=True)
    simulated = torch.load(sim_dir / "final_model.pt", weights_only=True)
    assert deployed.keys() == simulated.keys()
    for name in simulated:
        assert torch.equal(deployed[name], simulated[name]), name


def test_the_final_model_is_saved_without_a_copy_where_whole_and_a_view_as_itself_alone(tmp_path):
    from fedcore.runtime.monitor import Monitor, _alone
    whole = torch.randn(1000)                   # a round's mean: all of its storage
    view = torch.randn(100_000)[10:20]          # a view of a larger storage (a message's bytes, a file)
    assert _alone(whole).data_ptr() == whole.data_ptr()   # no copy of a large model at the course's end
    Monitor(tmp_path).finalize(0.0, {"w": whole, "v": view})
    saved = torch.load(tmp_path / "final_model.pt", weights_only=True)
    assert torch.equal(saved["w"], whole) and torch.equal(saved["v"], view)
    # the view's 10 values went in, not the 100,000 of its storage (400 kB)
    assert (tmp_path / "final_model.pt").stat().st_size < 4000 + 40 + 4096
