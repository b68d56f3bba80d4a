"""The trainer's own plain-SGD update: taken only where `optimizer.step()` would do exactly
p <- p - lr * grad unobserved, and then the same model as torch's SGD, bit for bit."""
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fedcore.kernel.sgd_step import clear_grads, plain_sgd, sgd_update
from fedcore.runtime.course import Course
from tests.conftest import small_cfg


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _grads(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(7, 5, generator=g), torch.randint(0, 3, (7,), generator=g)
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("foreach", [None, False, True])
def test_the_update_is_torchs_sgd_step_bit_for_bit(foreach):
    ours, theirs = _model(), _model()
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.37, foreach=foreach)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.37, foreach=foreach)
    assert plain_sgd(opt_ours)
    for step in range(3):
        _grads(ours, step), _grads(theirs, step)
        sgd_update(opt_ours)
        opt_theirs.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            assert torch.equal(a, b)
    # and by hand, in float64: one more step is p - lr * grad (to float32 rounding)
    _grads(ours, 9)
    expected = [p.detach().double() - 0.37 * p.grad.double() for p in ours.parameters()]
    sgd_update(opt_ours)
    for p, e in zip(ours.parameters(), expected):
        assert torch.allclose(p.detach().double(), e, rtol=0, atol=1e-6)
    assert not opt_ours.state   # no momentum buffers, as torch keeps none without momentum


def test_sparse_gradients_and_parameters_without_gradients():
    emb_a, emb_b = nn.Embedding(10, 3, sparse=True), nn.Embedding(10, 3, sparse=True)
    emb_b.load_state_dict(emb_a.state_dict())
    extra = nn.Parameter(torch.ones(2))                  # never gets a gradient
    opt_a = torch.optim.SGD([*emb_a.parameters(), extra], lr=0.5)
    opt_b = torch.optim.SGD(emb_b.parameters(), lr=0.5)
    idx = torch.tensor([1, 4, 4, 7])
    emb_a(idx).pow(2).sum().backward()
    emb_b(idx).pow(2).sum().backward()
    assert plain_sgd(opt_a)
    sgd_update(opt_a)
    opt_b.step()
    assert torch.equal(emb_a.weight, emb_b.weight) and torch.equal(extra, torch.ones(2))
    clear_grads(opt_a)
    assert emb_a.weight.grad is None


class _MySGD(torch.optim.SGD):
    pass


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=1e-4),
    lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True),
    lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1)),
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: _MySGD(ps, lr=0.1),
], ids=["momentum", "weight_decay", "maximize", "tensor_lr", "adam", "subclass"])
def test_anything_but_plain_sgd_takes_the_optimizers_own_step(make):
    assert not plain_sgd(make(_model().parameters()))


def test_hooks_a_scheduler_or_a_patched_step_take_the_optimizers_own_step():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert plain_sgd(opt)
    for register in (opt.register_step_pre_hook, opt.register_step_post_hook):
        handle = register(lambda *a: None)
        assert not plain_sgd(opt)
        handle.remove()
        assert plain_sgd(opt)
    handle = register_optimizer_step_post_hook(lambda *a: None)
    try:
        assert not plain_sgd(opt)
    finally:
        handle.remove()
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)   # wraps opt.step on the instance
    assert not plain_sgd(opt)


def _fit(hooked: bool):
    course = Course(small_cfg(train__local_steps=5)).build()
    trainer, seen = course.trainer, []
    if hooked:   # an observer forces optimizer.step(): the reference
        trainer.optimizer.register_step_post_hook(lambda *a: seen.append(1))
    received = course.server.aggregator.broadcast(1)
    result = trainer.fit(1, course.data.clients[1], received, 1)
    return result.content["model"], len(seen)


def test_a_trainers_fit_equals_the_one_through_optimizer_step():
    lean, n_lean = _fit(hooked=False)
    stepped, n_stepped = _fit(hooked=True)
    assert n_lean == 0 and n_stepped == 5
    assert lean.keys() == stepped.keys()
    assert all(torch.equal(lean[k], stepped[k]) for k in lean)
