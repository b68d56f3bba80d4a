"""On a CUDA GPU: dropout draws each client's masks from its own CPU stream (so a course on the
GPU has the CPU's masks and the vectorized engine runs every fit batched with dropout on), and
the vectorized engine's CUDA graphs give the eager descent's numbers."""
import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import small_cfg
from tests.test_random_layers import MODELS, _diff, _images, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; torch sees none on this machine")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_course_with_dropout_on_cuda_draws_the_cpu_masks(model):
    _, _, cpu = _run(model, "sequential")
    _, _, gpu = _run(model, "sequential", device="cuda")
    _, _, off = _run(model, "sequential", device="cuda", model__dropout=0.0, model__mlp_dropout=0.0)
    cpu_side = {k: v.cpu() for k, v in gpu.items()}
    assert _diff(cpu_side, {k: v.cpu() for k, v in off.items()}) > 1e-3   # dropout is on
    assert _diff(cpu_side, cpu) < 1e-5      # the same masks: only the kernels' rounding differs


@pytest.fixture
def no_tf32(monkeypatch):
    """cuDNN's convolutions in full float32: by default torch lets them round their inputs to
    TF32 (10-bit mantissas), and a batched (grouped) convolution rounds differently from one
    client's, which would hide a real difference under that rounding."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_vectorized_on_cuda_runs_every_fit_batched_with_dropout_on(model, no_tf32):
    _, _, seq = _run(model, "sequential", device="cuda")
    course, summary, vec = _run(model, "vectorized", device="cuda")
    assert summary["sequential_fits"] == 0 and summary["batched_fits"] == 3 * 4
    assert _diff(seq, vec) < 1e-5


def _five_rounds(model: str, graphs: bool):
    cfg = small_cfg(None, executor="vectorized", device="cuda", torch_threads=1,
                    train__local_steps=3, federate__total_round_num=5,
                    executor__vectorized__cuda_graphs=graphs, **MODELS[model])
    # all 5 clients every round, 20 samples each: three batches of 10 in every round, so every
    # round's group has one shape (seen in round 1, captured in round 2, replayed in 3 to 5)
    course = Course(cfg).build(_images(n=20))
    summary = course.run()
    return summary, {k: v.detach().clone() for k, v in course.server.aggregator.global_state.items()}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_cuda_graphs_give_the_eager_numbers(model):
    eager_summary, eager = _five_rounds(model, graphs=False)
    summary, graphed = _five_rounds(model, graphs=True)
    assert "cuda_graph_replays" not in eager_summary
    assert summary["cuda_graph_replays"] == 3
    assert _diff(eager, graphed) < 1e-6
