"""The vectorized executor's dense step gives `vmap(grad(...))`'s numbers bit for bit (shared
parameters in a group's first step, each client's own afterwards), applies only to
Flatten/Linear/ReLU stacks with class-index labels, and leaves a course's final model exactly
as the `vmap` form makes it."""
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

import fedcore.execution.vectorized as vectorized
from fedcore.runtime.course import Course
from fedcore.execution.dense_step import DenseStep
from tests.conftest import small_cfg


def _vmap_step(model, shared):
    def objective(params, x, y):   # the executor's objective for class indices
        out = functional_call(model, params, (x,))
        return -torch.log_softmax(out, 1).gather(1, y.unsqueeze(1)).sum() / y.shape[0]
    return vmap(grad_and_value(objective), in_dims=(None, 0, 0) if shared else 0)


MODELS = {
    "logreg": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), (1, 28, 28), 10),
    "mlp": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.ReLU(), nn.Linear(7, 3)),
            (1, 3, 4), 3),
    "deep": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 7), nn.ReLU(), nn.Linear(7, 5),
                                   nn.ReLU(), nn.Linear(5, 3)), (12,), 3),
    "no_bias_relu_first": (lambda: nn.Sequential(nn.Linear(12, 7, bias=False), nn.ReLU(),
                                                 nn.Flatten(), nn.Linear(7, 3)), (12,), 3),
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none on this machine"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [True, False], ids=["first_step", "own_parameters"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clients, batch", [(2, 1), (5, 4), (30, 10)])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_dense_step_equals_vmap_bit_for_bit(name, clients, batch, dtype, shared, device):
    make, shape, classes = MODELS[name]
    torch.manual_seed(clients * 100 + batch)
    model = make().to(dtype)
    params = {n: p.detach() for n, p in model.named_parameters()}
    if not shared:   # each client's own parameters, as after a first step
        params = {n: p + 0.1 * torch.randn((clients,) + p.shape, dtype=dtype) for n, p in params.items()}
    x = torch.randn((clients, batch) + shape, dtype=dtype)
    y = torch.randint(0, classes, (clients, batch))
    model.to(device)
    params, x, y = {n: p.to(device) for n, p in params.items()}, x.to(device), y.to(device)
    with torch.enable_grad():
        grads, loss = _vmap_step(model, shared)(params, x, y)
    dense = DenseStep.of(model, "cross_entropy")
    assert dense is not None and dense.applies(x, y)
    d_grads, d_loss = dense(params, x, y, shared=shared)
    assert d_grads.keys() == grads.keys()
    assert all(torch.equal(d_grads[k], grads[k]) for k in grads)
    assert torch.equal(d_loss, loss)


def test_dense_step_applies_only_where_it_knows_the_operations():
    linear = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    assert DenseStep.of(linear, "mse") is None                        # another loss
    assert DenseStep.of(nn.Sequential(nn.Linear(4, 2), nn.ReLU()), "cross_entropy") is None
    assert DenseStep.of(nn.Sequential(nn.Linear(4, 3), nn.Dropout(), nn.Linear(3, 2)),
                             "cross_entropy") is None                       # an unknown layer
    assert DenseStep.of(nn.Sequential(nn.Flatten(0), nn.Linear(4, 2)), "cross_entropy") is None
    assert DenseStep.of(nn.Linear(4, 2), "cross_entropy") is None      # not a Sequential
    hooked = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    hooked[1].register_forward_hook(lambda *a: None)
    assert DenseStep.of(hooked, "cross_entropy") is None               # hooks would not run
    dense = DenseStep.of(linear, "cross_entropy")
    y = torch.zeros(3, 2, dtype=torch.long)
    assert dense.applies(torch.zeros(3, 2, 1, 4), y)
    assert not dense.applies(torch.zeros(3, 2, 1, 4), y.float())           # soft labels
    no_flatten = DenseStep.of(nn.Sequential(nn.Linear(4, 2)), "cross_entropy")
    assert no_flatten.applies(torch.zeros(3, 2, 4), y)
    assert not no_flatten.applies(torch.zeros(3, 2, 1, 4), y)              # a Linear on images


@pytest.mark.parametrize("model", [dict(model__type="logreg"),
                                   dict(model__type="mlp", model__hidden=[7])])
def test_a_course_ends_with_the_same_model_with_or_without_the_dense_step(model, monkeypatch):
    # two local steps (shared parameters, then each client's own), momentum carried between them
    keys = dict(executor="vectorized", torch_threads=1, train__local_steps=2,
                train__optimizer__momentum=0.5, federate__total_round_num=3, **model)
    used = []
    real_call = DenseStep.__call__

    def counted(self, *a, shared=True):
        used.append(shared)
        return real_call(self, *a, shared=shared)
    monkeypatch.setattr(DenseStep, "__call__", counted)
    course = Course(small_cfg(None, **keys)).build()
    course.run()
    dense = dict(course.server.aggregator.global_state)
    assert set(used) == {True, False} and course.trainer.batched_fits > 0 and course.trainer.sequential_fits == 0
    monkeypatch.setattr(vectorized.DenseStep, "of", classmethod(lambda cls, m, loss: None))
    course = Course(small_cfg(None, **keys)).build()
    course.run()
    assert all(torch.equal(dense[k], v) for k, v in course.server.aggregator.global_state.items())


def _force_check(monkeypatch, **changes):
    """Reset the once-per-process choice of operations, with `changes` to the module first."""
    import fedcore.execution.dense_step as dense_step
    monkeypatch.setattr(dense_step, "_chosen", None)
    for name, value in changes.items():
        monkeypatch.setattr(dense_step, name, value)
    return dense_step


@pytest.mark.parametrize("broken", ["missing", "other_numbers"])
def test_private_ops_that_fail_their_check_give_way_to_public_ones_with_the_same_numbers(
        broken, monkeypatch, caplog):
    if broken == "missing":   # a torch without the private kernel
        monkeypatch.delattr(torch, "_log_softmax_backward_data")
        dense_step = _force_check(monkeypatch)
    else:                     # a private kernel whose meaning changed: ReLU's gradient passes all
        import fedcore.execution.dense_step as ds
        dense_step = _force_check(monkeypatch, PRIVATE=(ds._private_log_softmax, lambda g, out: g))
    make, shape, classes = MODELS["deep"]
    torch.manual_seed(3)
    model = make()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x, y = torch.randn((5, 4) + shape), torch.randint(0, classes, (5, 4))
    with torch.enable_grad():
        grads, loss = _vmap_step(model, True)(params, x, y)
    dense = DenseStep.of(model, "cross_entropy")
    with caplog.at_level("WARNING", logger="fedcore.dense_step"):
        for _ in range(2):
            d_grads, d_loss = dense(params, x, y)
            assert all(torch.equal(d_grads[k], grads[k]) for k in grads) and torch.equal(d_loss, loss)
    assert dense_step._chosen is dense_step.PUBLIC
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "public operations with the same numbers" in lines[0]   # logged once
    assert ("_log_softmax_backward_data" in lines[0]) == (broken == "missing")


def test_the_public_operations_give_vmaps_numbers_bit_for_bit(monkeypatch):
    """What the fallback would compute, on every layer stack, dtype and form of the grid above."""
    import fedcore.execution.dense_step as dense_step
    monkeypatch.setattr(dense_step, "_chosen", dense_step.PUBLIC)
    for name in sorted(MODELS):
        for clients, batch in [(2, 1), (30, 10)]:
            for dtype in (torch.float32, torch.float64):
                for shared in (True, False):
                    test_dense_step_equals_vmap_bit_for_bit(name, clients, batch, dtype, shared, "cpu")
