"""The `device` key: cpu (the default) gives the numbers fedcore always gave; a device that is
not present is exit 2 with one line; what leaves a course (checkpoints, final model, states
in the store) is on the CPU. The tests marked `cuda` run a course on a GPU wherever torch sees
one, and compare it with the CPU."""
import pytest
import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from fedcore.runtime.device import DeviceStateStore, place_data, resolve_device, to_cpu, to_device
from fedcore.kernel.errors import ConfigError
from fedcore.run import main
from fedcore.scenarios.data import ClientData, FederatedData, Split
from fedcore.kernel.state import MemoryStateStore
from tests.conftest import small_cfg

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU; torch sees none on this machine")


def _final(**overrides):
    course = Course(small_cfg(None, torch_threads=1, **overrides)).build()
    course.run()
    return course, course.server.aggregator.global_state


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_explicit_cpu_equals_the_default_bit_for_bit(executor):
    extra = dict(algorithm__name="scaffold", train__local_steps=3, federate__total_round_num=3)
    default, a = _final(executor=executor, **extra)
    explicit, b = _final(executor=executor, device="cpu", **extra)
    assert default.cfg["device"] == "cpu" and default.device == torch.device("cpu")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda records: [{k: v for k, v in r.items() if k != "wall_time"} for r in records]
    assert strip(default.monitor.records) == strip(explicit.monitor.records)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_exit_2_with_one_line(capsys):
    rc = main(["--cfg", "scenarios/quickstart.yaml", "device=cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "device: cuda" in err[0] and "no CUDA GPU" in err[0]


@pytest.mark.parametrize("spec, words", [("cuda:99", "cuda:99"), ("gpu", "expected auto, cpu"),
                                         ("cuda:x", "expected auto, cpu")])
def test_a_device_that_is_not_there_or_not_a_device_is_exit_2(spec, words, capsys):
    rc = main(["--cfg", "scenarios/quickstart.yaml", f"device={spec}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and words in err[0]


def test_auto_picks_the_best_device_present():
    expected = "cuda" if torch.cuda.is_available() else \
        "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected


def test_moving_to_the_device_a_tensor_is_on_is_no_copy():
    t = torch.arange(3.0)
    tree = {"a": t, "b": [t, 2], "c": {"d": (t,)}, "e": "text"}
    moved = to_device(tree, torch.device("cpu"))
    assert moved["a"] is t and moved["b"][0] is t and moved["c"]["d"][0] is t
    assert moved["b"][1] == 2 and moved["e"] == "text" and isinstance(moved["c"]["d"], tuple)
    assert to_cpu(tree)["c"]["d"][0] is t


def test_the_device_store_keeps_states_on_the_cpu():
    inner = MemoryStateStore()
    store = DeviceStateStore(inner, resolve_device("auto"))
    store.save(3, {"c_i": {"w": torch.ones(2, device=store.device)}, "sampler": {"epoch": 1}})
    assert inner.load(3)["c_i"]["w"].device.type == "cpu"
    assert store.load(3)["c_i"]["w"].device == torch.ones(1, device=store.device).device
    assert 3 in store and 4 not in store


def test_torch_deterministic_switches_deterministic_kernels_on():
    was = torch.are_deterministic_algorithms_enabled()
    try:
        Course(small_cfg(None, torch_deterministic=True)).build()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)


# ---------------------------------------------------------------- on a GPU
@cuda
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "feddyn"])
def test_a_course_on_cuda_gives_the_cpu_numbers(algorithm):
    extra = dict(algorithm__name=algorithm, train__local_steps=3, federate__total_round_num=3)
    _, cpu = _final(**extra)
    course, gpu = _final(device="cuda", **extra)
    assert all(t.device.type == "cuda" for t in gpu.values())
    assert course.data.clients[1].train.x.device.type == "cuda"      # small data: kept there
    assert max(float((cpu[k] - gpu[k].cpu()).abs().max()) for k in cpu) < 1e-5
    states = [course.store.load(c) for c in course.client_ids if c in course.store]
    assert all(t.device.type == "cpu" for s in states for t in _tensors(s))


@cuda
def test_data_kept_in_cpu_memory_are_moved_per_batch():
    _, on_gpu = _final(device="cuda", train__local_steps=3)
    course, per_batch = _final(device="cuda", device_data_bytes=0, train__local_steps=3)
    assert course.data.clients[1].train.x.device.type == "cpu"
    assert all(torch.equal(on_gpu[k], per_batch[k]) for k in on_gpu)


@cuda
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_vectorized_on_cuda_equals_sequential_on_cuda(algorithm):
    extra = dict(algorithm__name=algorithm, train__local_steps=3, federate__total_round_num=3,
                 device="cuda")
    _, seq = _final(**extra)
    course, vec = _final(executor="vectorized", **extra)
    assert course.trainer.batched_fits > 0
    assert max(float((seq[k] - vec[k]).abs().max()) for k in seq) < 1e-5


@cuda
def test_a_checkpoint_written_on_cuda_resumes_on_the_cpu(tmp_path):
    extra = dict(algorithm__name="scaffold", train__local_steps=2, federate__total_round_num=4)
    _, straight = _final(**extra)
    first = Course(small_cfg(tmp_path / "gpu", device="cuda", checkpoint__every=1,
                             **{**extra, "federate__total_round_num": 2})).build()
    first.run()
    saved = sorted((tmp_path / "gpu").glob("**/*.pt"))
    assert saved and all(t.device.type == "cpu" for f in saved
                         for t in _tensors(torch.load(f, weights_only=True)))
    ckpt = [f for f in saved if f.name != "final_model.pt"][-1]
    _, resumed = _final(resume_from=str(ckpt), **extra)
    assert max(float((straight[k] - resumed[k]).abs().max()) for k in straight) < 1e-5


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_device_is_resolved_when_the_config_loads():
    with pytest.raises(ConfigError, match="device"):
        load_config(None, extra={"device": "cuda:12345"})


def test_clients_made_on_access_stay_where_they_are_made():
    """A mapping that makes each client's data when asked (10^6 clients need no resident
    shards) cannot be moved whole: the trainer moves its batches instead."""
    class OnAccess(dict):
        def __missing__(self, cid):
            return ClientData(Split(torch.full((3, 2), float(cid)), torch.zeros(3, dtype=torch.long)),
                              Split(torch.empty(0, 2), torch.empty(0, dtype=torch.long)),
                              Split(torch.empty(0, 2), torch.empty(0, dtype=torch.long)))

        def __len__(self):
            return 1000
    data = FederatedData(OnAccess(), Split(torch.zeros(2, 2), torch.zeros(2, dtype=torch.long)), (2,), 2)
    assert place_data(data, torch.device("cuda"), None) is data
    assert float(data.clients[7].train.x[0, 0]) == 7.0
