"""Server optimizers: Reddi et al.'s Algorithm 2 (FedAdagrad, FedAdam, FedYogi) and FedAvgM
against hand-computed two-round numbers in float64, the limiting cases (sgd with lr 1 is the
plain aggregate, sgdm with momentum 0 is sgd), composition with other aggregators and rules,
refusals, checkpoint/resume with Adam and Yogi state, and the vectorized executor."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedcore.algorithms.combine import replace_combination
from fedcore.algorithms.fedavg import FedAvgAggregator
from fedcore.algorithms.robust import coordinate_median
from fedcore.execution.batching import BatchingTrainer
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.server_optimizer import ServerOptimizer, install
from tests.conftest import small_cfg

D = torch.float64


class Tiny(nn.Module):
    """A trainable parameter, a frozen one and a float buffer: only `w` is optimized."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=D))
        self.frozen = nn.Parameter(torch.tensor([0.5], dtype=D), requires_grad=False)
        self.register_buffer("running", torch.tensor([0.0], dtype=D))


class _Registry:
    def __init__(self):
        self.extras = {}

    def register(self, name, get, set_):
        self.extras[name] = (get, set_)


def server_with(aggregator_cls=FedAvgAggregator, weighting="num_samples", **keys):
    """A FedAvg server (Tiny model, 2 clients) with the server optimizer `keys` installed."""
    cfg = small_cfg(aggregator__weighting=weighting, **{f"server_optimizer__{k}": v for k, v in keys.items()})
    model = Tiny()
    server = SimpleNamespace(course=SimpleNamespace(cfg=cfg), model=model,
                             aggregator=aggregator_cls(model, cfg, 2))
    checkpointer = _Registry()
    opt = install(server, checkpointer)
    return server, opt, checkpointer


def round_(server, moves, r=1, n=(1, 1), extra=None):
    """Each client returns the current global model plus its move of `w` (and `extra`)."""
    agg = server.aggregator
    ups = []
    for cid, (move, ni) in enumerate(zip(moves, n), start=1):
        model = {k: v.clone() for k, v in agg.global_state.items()}
        model["w"] = model["w"] + torch.tensor(move, dtype=D)
        model.update(extra or {})
        ups.append(ReceivedUpdate(cid, {"model": model, "num_samples": ni}, r, 0))
    return agg.aggregate(ups, r)


# Two rounds: the clients' mean moves are Δ1 = [0.5, -1] and Δ2 = [0.25, 0.5].
ROUND1, ROUND2 = ([1.0, -2.0], [0.0, 0.0]), ([0.5, 1.0], [0.0, 0.0])
ADAPTIVE = dict(lr=0.1, beta1=0.9, beta2=0.99, tau=0.1)   # v_{-1} = tau^2 = 0.01

# x0 = [1, 2]; m_t = 0.9 m + 0.1 Δ_t: m1 = [0.05, -0.1], m2 = [0.07, -0.04];
# x_{t+1} = x_t + 0.1 m_t / (sqrt(v_t) + 0.1), per coordinate.
EXPECTED = {
    # v1 = 0.01 + Δ1² = [0.26, 1.01]; v2 = v1 + Δ2² = [0.3225, 1.26]
    "adagrad": ([0.26, 1.01], [1.0081980390271856, 1.9909501243788792],
                [0.3225, 1.26], [1.0186787937217783, 1.9876781332875761]),
    # v1 = 0.99 * 0.01 + 0.01 Δ1² = [0.0124, 0.0199]; v2 = 0.99 v1 + 0.01 Δ2² = [0.012901, 0.022201]
    "adam": ([0.0124, 0.0199], [1.023656848451251, 1.9585178183872134],
             [0.012901, 0.022201], [1.0564310585845076, 1.942453561359101]),
    # v1 = 0.01 - 0.01 Δ1² sign(0.01 - Δ1²) = 0.01 + 0.01 Δ1² = [0.0125, 0.02];
    # v2 = v1 + 0.01 Δ2² (v1 < Δ2² in both coordinates) = [0.013125, 0.0225]
    "yogi": ([0.0125, 0.02], [1.023606797749979, 1.9585786437626904],
             [0.013125, 0.0225], [1.056231036667506, 1.9425786437626904]),
}


def t(values):
    return torch.tensor(values, dtype=D)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_adaptive_optimizers_two_rounds_by_hand(kind):
    v1, x1, v2, x2 = EXPECTED[kind]
    server, opt, _ = server_with(type=kind, **ADAPTIVE)
    metrics = round_(server, ROUND1, 1)
    g = server.aggregator.global_state
    assert torch.allclose(g["w"], t(x1), rtol=0, atol=1e-12)
    assert torch.allclose(opt.m["w"], t([0.05, -0.1]), rtol=0, atol=1e-15)
    assert torch.allclose(opt.v["w"], t(v1), rtol=0, atol=1e-15)
    assert metrics["server_pseudo_grad_norm"] == pytest.approx((0.25 + 1.0) ** 0.5)
    round_(server, ROUND2, 2)
    assert torch.allclose(server.aggregator.global_state["w"], t(x2), rtol=0, atol=1e-12)
    assert torch.allclose(opt.m["w"], t([0.07, -0.04]), rtol=0, atol=1e-12)
    assert torch.allclose(opt.v["w"], t(v2), rtol=0, atol=1e-12)
    # the frozen parameter and the float buffer take the plain aggregate (here: unchanged)
    assert set(opt.m) == {"w"}
    assert torch.equal(server.aggregator.global_state["frozen"], t([0.5]))


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_uniform_weighting_steps_from_algorithm_2s_unweighted_mean(kind):
    # Reddi et al. average the clients' deltas alike, Δ = (1/|S|) Σ Δi: with sample counts
    # (1, 3) and aggregator.weighting: uniform the steps are the hand-computed ones above
    _, x1, _, x2 = EXPECTED[kind]
    server, _, _ = server_with(weighting="uniform", type=kind, **ADAPTIVE)
    round_(server, ROUND1, 1, n=(1, 3))
    assert torch.allclose(server.aggregator.global_state["w"], t(x1), rtol=0, atol=1e-12)
    round_(server, ROUND2, 2, n=(1, 3))
    assert torch.allclose(server.aggregator.global_state["w"], t(x2), rtol=0, atol=1e-12)
    # FedAvg's sample weighting steps from another mean with the same counts
    weighted, _, _ = server_with(type=kind, **ADAPTIVE)
    round_(weighted, ROUND1, 1, n=(1, 3))
    assert (weighted.aggregator.global_state["w"] - t(x1)).abs().max() > 1e-3


def test_aggregations_with_a_weighting_of_their_own_refuse_uniform():
    with pytest.raises(ConfigError, match="aggregator.weighting: uniform: the ScaffoldAggregator"):
        Course(small_cfg(algorithm__name="scaffold", aggregator__weighting="uniform")).build()


def test_adam_with_bias_correction_by_hand():
    # m̂_t = m_t / (1 - 0.9^t), v̂_t = v_t / (1 - 0.99^t): round 1 divides m by 0.1, v by 0.01
    server, _, _ = server_with(type="adam", bias_correction=True, **ADAPTIVE)
    round_(server, ROUND1, 1)
    assert torch.allclose(server.aggregator.global_state["w"],
                          t([1.041201336283171, 1.9338043637390612]), rtol=0, atol=1e-12)
    round_(server, ROUND2, 2)
    assert torch.allclose(server.aggregator.global_state["w"],
                          t([1.0819034022563787, 1.9155964145959667]), rtol=0, atol=1e-12)


def test_fedavgm_two_rounds_by_hand():
    # m1 = Δ1 = [0.5, -1], x1 = x0 + 0.1 m1 = [1.05, 1.9];
    # m2 = 0.9 m1 + Δ2 = [0.7, -0.4], x2 = x1 + 0.1 m2 = [1.12, 1.86]
    server, opt, _ = server_with(type="sgdm", lr=0.1, momentum=0.9)
    round_(server, ROUND1, 1)
    assert torch.allclose(server.aggregator.global_state["w"], t([1.05, 1.9]), rtol=0, atol=1e-12)
    round_(server, ROUND2, 2)
    assert torch.allclose(server.aggregator.global_state["w"], t([1.12, 1.86]), rtol=0, atol=1e-12)
    assert torch.allclose(opt.m["w"], t([0.7, -0.4]), rtol=0, atol=1e-12)


def test_sgd_two_rounds_by_hand_sample_weighted():
    # n = (1, 3): Δ1 = 1/4 [1, -2] = [0.25, -0.5]; x1 = x0 + 0.5 Δ1 = [1.125, 1.75];
    # Δ2 = 1/4 [0.5, 1] = [0.125, 0.25]; x2 = [1.1875, 1.875]
    server, _, _ = server_with(type="sgd", lr=0.5)
    round_(server, ROUND1, 1, n=(1, 3))
    assert torch.allclose(server.aggregator.global_state["w"], t([1.125, 1.75]), rtol=0, atol=1e-12)
    round_(server, ROUND2, 2, n=(1, 3))
    assert torch.allclose(server.aggregator.global_state["w"], t([1.1875, 1.875]), rtol=0, atol=1e-12)


def test_sgd_with_lr_one_is_the_aggregators_own_result_bit_for_bit():
    server, opt, _ = server_with(type="sgd", lr=1.0)
    assert opt is None and "server_optimizer" not in vars(server.aggregator)
    plain = SimpleNamespace(aggregator=FedAvgAggregator(Tiny(), small_cfg(), 2))
    for r, moves in enumerate((ROUND1, ROUND2), start=1):
        round_(server, moves, r, n=(2, 5))
        round_(plain, moves, r, n=(2, 5))
    for k, v in plain.aggregator.global_state.items():
        assert torch.equal(server.aggregator.global_state[k], v), k


@pytest.mark.parametrize("kind", ["sgdm", "nesterov"])
def test_momentum_zero_equals_sgd_exactly(kind):
    a, _, _ = server_with(type=kind, lr=0.7, momentum=0.0)
    b, _, _ = server_with(type="sgd", lr=0.7)
    for r, moves in enumerate((ROUND1, ROUND2, ROUND1), start=1):
        round_(a, moves, r)
        round_(b, moves, r)
        assert torch.equal(a.aggregator.global_state["w"], b.aggregator.global_state["w"]), r


def test_courses_sgd_lr_one_equals_fedavg_and_sgdm_zero_equals_sgd(tmp_path):
    common = dict(model__dtype="float64", federate__total_round_num=3, eval__clients=False)

    def final(name, **keys):
        Course(small_cfg(tmp_path / name, **common, **keys)).run()
        return torch.load(tmp_path / name / "final_model.pt", weights_only=True)

    fedavg = final("fedavg")
    sgd1 = final("sgd1", server_optimizer__type="sgd", server_optimizer__lr=1.0)
    assert all(torch.equal(fedavg[k], sgd1[k]) for k in fedavg)
    sgd = final("sgd", server_optimizer__type="sgd", server_optimizer__lr=0.5)
    sgdm0 = final("sgdm0", server_optimizer__type="sgdm", server_optimizer__lr=0.5,
                  server_optimizer__momentum=0.0)
    assert all(torch.equal(sgd[k], sgdm0[k]) for k in sgd)
    assert not torch.equal(sgd["1.weight"], fedavg["1.weight"])


def test_state_dict_round_trip_continues_the_same_trajectory():
    full, opt, _ = server_with(type="yogi", **ADAPTIVE)
    round_(full, ROUND1, 1)
    saved, saved_global = opt.state_dict(), dict(full.aggregator.global_state)
    resumed, opt2, _ = server_with(type="yogi", **ADAPTIVE)
    resumed.aggregator.global_state = saved_global
    opt2.load_state_dict(saved)
    round_(full, ROUND2, 2)
    round_(resumed, ROUND2, 2)
    assert torch.equal(full.aggregator.global_state["w"], resumed.aggregator.global_state["w"])


def test_applied_to_the_robust_aggregate():
    # three clients; the coordinate median of their moves is [0.5, -1] (Δ1 of the table above)
    server, opt, _ = server_with(type="adam", **ADAPTIVE)

    def median(deltas, weights, ids, r):
        return {n: coordinate_median(torch.stack([d[n] for d in deltas])) for n in deltas[0]}, {}

    replace_combination(server.aggregator, median, "median")
    agg = server.aggregator
    ups = []
    for cid, move in enumerate(([0.5, -1.0], [9.0, -9.0], [-3.0, 4.0]), start=1):
        model = {k: v.clone() for k, v in agg.global_state.items()}
        model["w"] = model["w"] + t(move)
        ups.append(ReceivedUpdate(cid, {"model": model, "num_samples": 1}, 1, 0))
    agg.aggregate(ups, 1)
    assert torch.allclose(agg.global_state["w"], t(EXPECTED["adam"][1]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("keys, match", [
    (dict(algorithm__name="feddyn"), "server_optimizer.type: algorithm feddyn"),
    (dict(algorithm__name="diloco", train__local_steps=2, train__optimizer__type="adamw",
          train__preserve_optimizer_state=True), "algorithm.diloco.outer_optimizer"),
    (dict(algorithm__name="fedbuff", algorithm__fedbuff__server_lr=0.5),
     "algorithm.fedbuff.server_lr"),
    (dict(algorithm__name="fedmos", algorithm__fedmos__server_momentum=0.5),
     "algorithm.fedmos.server_momentum"),
])
def test_refused_combinations_name_the_key(keys, match):
    with pytest.raises(ConfigError, match=match):
        small_cfg(server_optimizer__type="adam", **keys)
    small_cfg(**keys)   # without a server optimizer the same course is fine


def _final(tmp_path, name, **keys):
    Course(small_cfg(tmp_path / name, model__dtype="float64", eval__clients=False, **keys)).run()
    return torch.load(tmp_path / name / "final_model.pt", weights_only=True)


@pytest.mark.parametrize("algorithm, own", [
    # their own server step sizes are the sgd server optimizer's
    ("fedbuff", dict(algorithm__fedbuff__server_lr=0.5)),
    ("scaffold", dict(algorithm__scaffold__global_lr=0.5)),
])
def test_an_algorithms_own_server_lr_is_sgd(tmp_path, algorithm, own):
    keys = dict(algorithm__name=algorithm)
    if algorithm == "fedbuff":
        keys.update(asyn__use=True, asyn__min_received_num=3, federate__total_round_num=4)
    a = _final(tmp_path, "own", **keys, **own)
    b = _final(tmp_path, "opt", **keys, server_optimizer__type="sgd", server_optimizer__lr=0.5)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-12) for k in a)


def test_fedmos_server_momentum_is_fedavgm_with_lr_one(tmp_path):
    keys = dict(algorithm__name="fedmos", federate__total_round_num=3)
    a = _final(tmp_path, "own", algorithm__fedmos__server_momentum=0.5, **keys)
    b = _final(tmp_path, "opt", server_optimizer__type="sgdm", server_optimizer__lr=1.0,
               server_optimizer__momentum=0.5, **keys)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-12) for k in a)


@pytest.mark.parametrize("keys", [
    dict(algorithm__name="fedprox", algorithm__fedprox__mu=0.1),
    dict(algorithm__name="moon", model__type="moon_mlp"),
    dict(algorithm__name="fedmos"),
    dict(algorithm__name="fednova", data__partition="quantity"),
    dict(algorithm__name="fedasync", asyn__use=True, asyn__min_received_num=1),
    dict(aggregator__robust_rule="trimmed_mean", aggregator__trim_ratio=0.2),
])
def test_composes_with_every_server_rule(tmp_path, keys):
    """Adam follows each algorithm's own aggregate: its first step moves every coordinate by at
    most lr (0.1 |Δ| / (sqrt(0.99 tau² + 0.01 Δ²) + tau) < 1), so by at most lr sqrt(d) in all."""
    lr = 0.05
    Course(small_cfg(tmp_path, server_optimizer__type="adam", server_optimizer__lr=lr,
                     federate__total_round_num=2, eval__clients=False, **keys)).run()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = torch.load(tmp_path / "final_model.pt", weights_only=True)
    d = sum(v.numel() for v in final.values() if v.is_floating_point())
    assert len(rows) == 2 and all(r["server_pseudo_grad_norm"] > 0 for r in rows)
    assert 0 < rows[0]["server_update_norm"] <= lr * d ** 0.5


@pytest.mark.parametrize("kind", ["adam", "yogi"])
def test_resume_mid_course_equals_uninterrupted(tmp_path, kind):
    common = dict(federate__total_round_num=4, federate__sample_client_num=3, eval__clients=False,
                  server_optimizer__type=kind, server_optimizer__lr=0.05)
    Course(small_cfg(tmp_path / "full", checkpoint__every=2, **common)).run()
    ckpt = tmp_path / "full" / "checkpoints" / "round_2.pt"
    saved = torch.load(ckpt, weights_only=True)["extras"]["server_optimizer"]
    assert saved["t"] == 2 and set(saved["v"]) == {"1.weight", "1.bias"}
    Course(small_cfg(tmp_path / "resumed", resume_from=str(ckpt), **common)).run()
    rows = {d: (tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in ("full", "resumed")}
    strip = lambda line: {k: v for k, v in json.loads(line).items() if k != "wall_time"}  # noqa: E731
    assert [strip(x) for x in rows["full"]] == [strip(x) for x in rows["resumed"]]
    a = torch.load(tmp_path / "full" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "final_model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_checkpoint_without_server_optimizer_state(tmp_path):
    common = dict(federate__total_round_num=3, eval__clients=False)
    Course(small_cfg(tmp_path / "full", checkpoint__every=1, **common)).run()
    with pytest.raises(ConfigError, match="server_optimizer"):
        Course(small_cfg(tmp_path / "r", server_optimizer__type="adam", **common,
                         resume_from=str(tmp_path / "full" / "checkpoints" / "round_1.pt"))).build()


@pytest.mark.parametrize("kind", ["sgdm", "adam", "yogi"])
def test_vectorized_equals_sequential(kind):
    keys = dict(server_optimizer__type=kind, server_optimizer__lr=0.05, model__dtype="float64",
                train__local_steps=2, federate__total_round_num=3, torch_threads=1)
    seq = Course(small_cfg(None, executor="sequential", **keys)).build()
    seq.run()
    vec = Course(small_cfg(None, executor="vectorized", **keys)).build()
    vec.run()
    assert isinstance(vec.trainer, BatchingTrainer) and vec.trainer.batched_fits > 0
    a, b = seq.server.aggregator.global_state, vec.server.aggregator.global_state
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-12


def test_unknown_kind_is_refused():
    with pytest.raises(ConfigError, match="server_optimizer.type"):
        small_cfg(server_optimizer__type="lamb")
    with pytest.raises(ValueError, match="lamb"):
        ServerOptimizer("lamb", 0.1)


def _textbook_step(opt, state, name, d):
    """One step of Reddi et al.'s server optimizers written as the paper's expressions (new
    tensors everywhere), against which the optimizer's in-place step must agree bit for bit."""
    kind, lr, b1, b2, tau = opt.kind, opt.lr, opt.beta1, opt.beta2, opt.tau
    if kind in ("sgdm", "nesterov"):
        m = state.get(("m", name))
        m = d if m is None else opt.momentum * m + d
        state[("m", name)] = m
        return lr * (d + opt.momentum * m) if kind == "nesterov" else lr * m
    if kind == "sgd":
        return lr * d
    m = state.get(("m", name), torch.zeros_like(d)) * b1 + (1 - b1) * d
    v = state.get(("v", name), torch.full_like(d, tau ** 2))
    if kind == "adagrad":
        v = v + d * d
    elif kind == "adam":
        v = b2 * v + (1 - b2) * (d * d)
    else:
        v = v - (1 - b2) * (d * d) * torch.sign(v - d * d)
    state[("m", name)], state[("v", name)] = m, v
    t = state["t"]
    if opt.bias_correction:
        m = m / (1 - b1 ** t)
        if kind != "adagrad":
            v = v / (1 - b2 ** t)
    return lr * m / (v.sqrt() + tau)


@pytest.mark.parametrize("kind", ["sgd", "sgdm", "nesterov", "adam", "yogi", "adagrad"])
def test_the_server_step_is_the_textbook_expression_bit_for_bit(kind):
    g = torch.Generator().manual_seed(7)
    for bias_correction in (False, True):
        for dtype in (torch.float32, torch.float64):
            opt = ServerOptimizer(kind, 0.3, bias_correction=bias_correction)
            state = {"t": 0}
            x = {"w": torch.randn(40, 5, generator=g).to(dtype), "b": torch.randn(5, generator=g).to(dtype)}
            for r in range(4):
                agg = {k: v + torch.randn(v.shape, generator=g).to(dtype) * (0.01 if r % 2 else 3.0)
                       for k, v in x.items()}
                state["t"] += 1
                steps = {n: _textbook_step(opt, state, n, agg[n] - x[n]) for n in x}
                expected = {n: x[n] + steps[n] for n in x}
                norm = lambda ts: math.sqrt(sum(float(t.double().square().sum()) for t in ts))  # noqa: E731
                new, metrics = opt.apply(x, agg, ["w", "b"])
                assert all(torch.equal(new[n], expected[n]) for n in x), (kind, bias_correction, dtype, r)
                assert metrics == {"server_pseudo_grad_norm": norm(agg[n] - x[n] for n in x),
                                   "server_update_norm": norm(steps.values())}
                x = new


@pytest.mark.parametrize("kind", ["sgd", "sgdm", "nesterov", "adam", "yogi", "adagrad"])
def test_a_large_entry_is_stepped_band_by_band_to_the_same_bits(kind, monkeypatch):
    # Past server_optimizer.BAND values an entry is stepped a band at a time (a band's
    # temporaries, not a model's). Every value goes through the textbook expression's
    # operations, so the new model and the moments are the same bits; only the norms' squares
    # are summed in another order (float64 rounding). Bands of 1,000 values here stand in for
    # 2^20: 2,345 values make two whole bands and a short one.
    import fedcore.runtime.server_optimizer as so
    monkeypatch.setattr(so, "BAND", 1000)
    g = torch.Generator().manual_seed(11)
    for bias_correction in (False, True):
        opt = ServerOptimizer(kind, 0.3, bias_correction=bias_correction)
        state = {"t": 0}
        x = {"w": torch.randn(2345, generator=g), "b": torch.randn(7, generator=g)}
        for r in range(3):
            agg = {k: v + torch.randn(v.shape, generator=g) * (0.01 if r % 2 else 3.0) for k, v in x.items()}
            state["t"] += 1
            steps = {n: _textbook_step(opt, state, n, agg[n] - x[n]) for n in x}
            before = {k: dict(getattr(opt, k)) for k in ("m", "v")}
            kept = {k: {n: t.clone() for n, t in before[k].items()} for k in before}
            new, metrics = opt.apply(x, agg, ["w", "b"])
            assert all(torch.equal(new[n], x[n] + steps[n]) for n in x), (kind, bias_correction, r)
            for n in x:   # the moments too, and the old ones were not written in place
                if ("m", n) in state and kind != "sgd":
                    assert torch.equal(opt.m[n], state[("m", n)])
                if ("v", n) in state:
                    assert torch.equal(opt.v[n], state[("v", n)])
                for k in ("m", "v"):
                    if n in before[k]:
                        assert before[k][n] is not getattr(opt, k)[n] and torch.equal(before[k][n], kept[k][n])
            norm = lambda ts: math.sqrt(sum(float(t.double().square().sum()) for t in ts))  # noqa: E731
            assert metrics["server_pseudo_grad_norm"] == pytest.approx(norm(agg[n] - x[n] for n in x), rel=1e-12)
            assert metrics["server_update_norm"] == pytest.approx(norm(steps.values()), rel=1e-12)
            x = new


def test_moments_laid_out_otherwise_keep_the_whole_entry_step(monkeypatch):
    # moments left non-contiguous by a step on transposed tensors (a checkpoint of another
    # layout): the next, contiguous round cannot step them band by band (a band is a slice of
    # the flat tensor) and takes the whole-entry step, with the same numbers
    import fedcore.runtime.server_optimizer as so
    monkeypatch.setattr(so, "BAND", 100)
    g = torch.Generator().manual_seed(5)
    for kind in ("sgdm", "adam"):
        opt, state = ServerOptimizer(kind, 0.3), {"t": 0}
        x = torch.randn(30, 20, generator=g)
        agg = x + torch.randn(30, 20, generator=g)
        state["t"] += 1
        step = _textbook_step(opt, state, "w", agg.t() - x.t())
        new, _ = opt.apply({"w": x.t()}, {"w": agg.t()}, ["w"])
        assert torch.equal(new["w"], x.t() + step) and not opt.m["w"].is_contiguous()
        x2 = new["w"].contiguous()
        agg2 = x2 + torch.randn(20, 30, generator=g)
        state["t"] += 1
        step = _textbook_step(opt, state, "w", agg2 - x2)
        new, _ = opt.apply({"w": x2}, {"w": agg2}, ["w"])
        assert torch.equal(new["w"], x2 + step), kind
