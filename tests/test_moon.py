"""MOON: two rounds against the loss written out from the paper, its FedAvg limit, work, history."""
import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.scenarios.moon_models import moon_cnn, moon_mlp
from fedcore.scenarios.data import ClientData, Split
from tests import drift_problem as P
from tests.conftest import small_cfg

MU, TAU, LR, STEPS = 2.0, 0.5, 0.1, 3
LABELS = {1: [0, 1, 2, 1], 2: [2, 2, 0, 1, 0]}
NAMES = ["head.0.weight", "head.0.bias", "head.2.weight", "head.2.bias", "classifier.weight",
         "classifier.bias"]


def _data(cid):
    x = torch.tensor(P._X[cid], dtype=torch.float64)
    y = torch.tensor(LABELS[cid])
    return ClientData(Split(x, y), Split(x[:0], y[:0]), Split(x, y))


def _cfg(**over):
    base = dict(algorithm__name="moon", model__type="moon_mlp", model__hidden=[], model__moon__proj_dim=3,
                model__dtype="float64", federate__client_num=2, train__batch_size=64,
                train__local_steps=STEPS, train__optimizer__lr=LR, algorithm__moon__mu=MU,
                algorithm__moon__temperature=TAU, algorithm__moon__buffer_size=2)
    base.update(over)
    return small_cfg(None, **base)


def _model(cfg):
    torch.manual_seed(3)
    return moon_mlp(cfg, (2,), 3).double()


# ---------------------------------------------------------------- the reference, from the equations
def _project(p, x):
    h = torch.clamp(x @ p[0].T + p[1], min=0.0)
    return h @ p[2].T + p[3]


def _cos(a, b):
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


def _loss(p, x, y, glob, prevs):
    z = _project(p, x)
    logits = z @ p[4].T + p[5]
    ce = (torch.logsumexp(logits, 1) - logits[torch.arange(len(y)), y]).mean()
    z_g = _project(glob, x)
    pos = torch.exp(_cos(z, z_g) / TAU)
    neg = sum((torch.exp(_cos(z, _project(q, x)) / TAU) for q in prevs), torch.zeros(len(y), dtype=x.dtype))
    return ce + MU * (-torch.log(pos / (pos + neg))).mean()


def _reference(params0, rounds):
    glob = [t.clone() for t in params0]
    history = {1: [], 2: []}
    for _ in range(rounds):
        local = {}
        for k in (1, 2):
            d = _data(k).train
            p = [t.clone().requires_grad_(True) for t in glob]
            for _ in range(STEPS):
                grads = torch.autograd.grad(_loss(p, d.x, d.y, glob, history[k]), p)
                p = [(t - LR * g).detach().requires_grad_(True) for t, g in zip(p, grads)]
            local[k] = [t.detach() for t in p]
            history[k] = (history[k] + [local[k]])[-2:]
        n1, n2 = len(LABELS[1]), len(LABELS[2])
        glob = [(n1 * a + n2 * b) / (n1 + n2) for a, b in zip(local[1], local[2])]
    return glob, history


def test_moon_two_rounds_match_the_paper_loss():
    cfg = _cfg()
    trainer, agg = P.build(cfg, _model(cfg))
    params0 = [agg.global_state[n].clone() for n in NAMES]
    works = []
    for r in (1, 2):
        results = P.run_round(trainer, agg, r, (1, 2), data=_data)
        works.append({k: res.work for k, res in results.items()})
    glob, history = _reference(params0, 2)
    for n, ref in zip(NAMES, glob):
        torch.testing.assert_close(agg.global_state[n], ref, rtol=0, atol=1e-6)
    for k in (1, 2):
        stored = trainer.store.load(k)["history"]
        assert len(stored) == 2
        for past, ref in zip(stored, history[k]):
            for n, t in zip(NAMES, ref):
                torch.testing.assert_close(past[n], t, rtol=0, atol=1e-6)
    # the contrastive term is live in round 2 (round 1 has no negatives, so l_con = 0 there)
    no_con, _ = _reference_without_contrast(params0)
    assert max((a - b).abs().max().item() for a, b in zip(glob, no_con)) > 1e-4
    fc = 1 / 3                                     # forward-only passes: 1 frozen model, then 2
    for k in (1, 2):
        n = len(LABELS[k])
        assert works[0][k] == pytest.approx(n * STEPS * (1 + fc))
        assert works[1][k] == pytest.approx(n * STEPS * (1 + 2 * fc))


def _reference_without_contrast(params0):
    global MU
    saved, MU = MU, 0.0
    try:
        return _reference(params0, 2)
    finally:
        MU = saved


def test_history_is_a_fifo_of_buffer_size():
    cfg = _cfg(algorithm__moon__buffer_size=1)
    trainer, agg = P.build(cfg, _model(cfg))
    for r in (1, 2, 3):
        results = P.run_round(trainer, agg, r, (1,), data=_data)
    hist = trainer.store.load(1)["history"]
    assert len(hist) == 1
    assert all(torch.equal(hist[0][n], results[1].content["model"][n]) for n in NAMES)


def test_mu_zero_is_fedavg_exactly(tmp_path):
    common = dict(model__type="moon_mlp", model__hidden=[16], model__moon__proj_dim=8)
    a = Course(small_cfg(tmp_path / "m", algorithm__name="moon", algorithm__moon__mu=0.0, **common)).run()
    b = Course(small_cfg(tmp_path / "f", algorithm__name="fedavg", **common)).run()
    mm = torch.load(tmp_path / "m" / "final_model.pt", weights_only=True)
    mf = torch.load(tmp_path / "f" / "final_model.pt", weights_only=True)
    assert all(torch.equal(mm[k], mf[k]) for k in mf)
    assert a["virtual_time"] == b["virtual_time"]


def test_moon_course_charges_forward_passes(tmp_path):
    common = dict(model__type="moon_mlp", model__hidden=[16], model__moon__proj_dim=8)
    a = Course(small_cfg(tmp_path / "m", algorithm__name="moon", **common)).run()
    b = Course(small_cfg(tmp_path / "f", algorithm__name="fedavg", **common)).run()
    assert a["virtual_time"] > b["virtual_time"]


def test_model_without_projection_head_is_refused():
    with pytest.raises(ConfigError, match="projection head"):
        small_cfg(None, algorithm__name="moon", model__type="logreg")


def test_moon_cnn_shapes():
    cfg = _cfg(model__moon__proj_dim=16)
    net = moon_cnn(cfg, (1, 28, 28), 10)
    z, logits = net.project_and_classify(torch.zeros(2, 1, 28, 28))
    assert z.shape == (2, 16) and logits.shape == (2, 10)
    with pytest.raises(ConfigError):
        moon_cnn(cfg, (8,), 3)
