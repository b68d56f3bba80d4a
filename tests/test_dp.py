"""DP on updates: clipping bounds the norm exactly, noise has std sigma*C, accounting in records."""
import json
import math

import pytest
import torch

from fedcore.algorithms.combine import flatten, float_names
from fedcore.algorithms.dp import central_dp_rule, clip_delta, gaussian_noise, privatize
from fedcore.algorithms.dp_accountant import DEFAULT_ORDERS, dp_epsilon
from fedcore.algorithms.dp_noise import noise_generator
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.sampling import PoissonSampler
from tests.conftest import small_cfg


def test_clipping_bounds_the_norm_exactly():
    v = torch.tensor([3.0, 4.0, 12.0], dtype=torch.float64)  # norm 13
    clipped, norm = clip_delta(v, 6.5)
    assert norm == 13.0 and clipped.tolist() == pytest.approx([1.5, 2.0, 6.0])
    assert clipped.norm().item() == pytest.approx(6.5, rel=1e-15)
    small, _ = clip_delta(v / 10, 6.5)
    assert torch.equal(small, v / 10)  # inside the ball: untouched


def test_privatize_without_noise_moves_the_model_by_exactly_C():
    ref = {"w": torch.ones(4, 5), "n": torch.tensor(7)}
    model = {"w": ref["w"] + 2.0, "n": torch.tensor(9)}  # delta norm 2 * sqrt(20)
    out, norm = privatize(model, ref, 1.5, 0.0, torch.Generator().manual_seed(0))
    assert norm == pytest.approx(2 * 20 ** 0.5)
    assert (out["w"] - ref["w"]).norm().item() == pytest.approx(1.5, rel=1e-6)
    assert out["n"].item() == 9 and out["w"] is not model["w"]  # integer entries pass through


def test_noise_std_is_sigma_times_C():
    n = 200_000
    ref = {"w": torch.zeros(n, dtype=torch.float64)}
    out, _ = privatize({"w": ref["w"].clone()}, ref, 2.0, 0.5, torch.Generator().manual_seed(1))
    noise = out["w"]
    assert noise.mean().item() == pytest.approx(0.0, abs=0.01)
    assert noise.std().item() == pytest.approx(0.5 * 2.0, rel=0.01)


def test_central_rule_clips_each_update_and_noises_the_mean():
    deltas = [{"w": torch.tensor([3.0, 4.0], dtype=torch.float64)},
              {"w": torch.tensor([0.0, 0.5], dtype=torch.float64)}]
    mean, m = central_dp_rule(1.0, 0.0, 0)(deltas, [10.0, 1.0], [1, 2], 1)
    assert mean["w"].tolist() == pytest.approx([0.3, 0.65]) and m["dp_clipped"] == 1  # equal weights
    noisy = [central_dp_rule(1.0, 2.0, 0)([{"w": torch.zeros(50_000, dtype=torch.float64)}] * 4,
                                          [1.0] * 4, [1, 2, 3, 4], r)[0]["w"] for r in range(2)]
    assert noisy[0].std().item() == pytest.approx(2.0 / 4, rel=0.02)  # sigma C / m
    assert not torch.equal(noisy[0], noisy[1])


def _run(tmp_path, **kw):
    summary = Course(small_cfg(tmp_path, **{"federate__total_round_num": 3, **kw})).run()
    return summary, [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_local_dp_on_a_fraction_of_clients_reports_epsilon(tmp_path):
    summary, records = _run(tmp_path, privacy__dp__mode="local", privacy__dp__fraction=0.5,
                            privacy__dp__noise_multiplier=2.0)
    assert summary["dp_noisy_clients"] == 3
    # every client takes part each round: the noisy releases are 3 Gaussian mechanisms (q = 1)
    assert [r["dp_epsilon"] for r in records] == pytest.approx(
        [dp_epsilon(1.0, 2.0, k, 1e-5) for k in (1, 2, 3)])


def test_local_dp_counts_every_release_received_refused_ones_included(tmp_path):
    # clients 1 and 2 add noise of std 1 per coordinate (C = 1): their updates lie far beyond 3x
    # the median distance of the others', so admission refuses both every round. Each was still
    # released: round k's epsilon is that of k Gaussian mechanisms, RDP k alpha / (2 sigma^2)
    summary, records = _run(tmp_path, federate__total_round_num=4, privacy__dp__mode="local",
                            privacy__dp__clients=[1, 2], privacy__dp__noise_multiplier=1.0,
                            privacy__dp__clip_norm=1.0, admission__norm_ratio=3.0,
                            train__optimizer__lr=0.01)
    assert [r["num_updates"] for r in records] == [4, 4, 4, 4]          # 6 sampled, the 2 noisy refused
    assert sum(summary["admission"].values()) == 8
    for k, r in zip((1, 2, 3, 4), records):
        by_hand = min(k * a / (2 * 1.0 ** 2) + math.log1p(-1 / a) - (math.log(1e-5) + math.log(a)) / (a - 1)
                      for a in DEFAULT_ORDERS)
        assert r["dp_epsilon"] == pytest.approx(by_hand, rel=1e-12)
    assert summary["dp_epsilon"] == records[-1]["dp_epsilon"]


@pytest.mark.parametrize("edge_rounds", [1, 2])
def test_local_dp_in_a_tree_counts_the_releases_its_edges_receive(tmp_path, edge_rounds):
    # 6 clients under 2 edges; clients 1 and 2 add noise. Their releases reach the edges, not
    # the cloud: counted there, as many as the updates each sent (captured on the way)
    course = Course(small_cfg(tmp_path, federate__total_round_num=3, topology__edges=2,
                              topology__edge_rounds=edge_rounds, privacy__dp__mode="local",
                              privacy__dp__clients=[1, 2], privacy__dp__noise_multiplier=1.0))
    course.build()
    sent = []
    course.comm.filters.append(lambda msg, receiver: sent.append(msg) or True)
    summary = course.run()
    k = max(sum(1 for m in sent if m.msg_type == "updates" and m.sender == c) for c in (1, 2))
    assert k == 3 * edge_rounds
    by_hand = min(k * a / 2 + math.log1p(-1 / a) - (math.log(1e-5) + math.log(a)) / (a - 1)
                  for a in DEFAULT_ORDERS)
    assert summary["dp_epsilon"] == pytest.approx(by_hand, rel=1e-12)


def test_local_dp_also_reports_epsilon_against_any_other_data_of_the_client(tmp_path):
    # replace-one: ||clip(a) - clip(b)|| <= 2C, so k Gaussian releases of noise sigma C have
    # RDP k alpha (2C)^2 / (2 sigma^2 C^2) = k alpha 2 / sigma^2 (Mironov 2017, Prop. 7)
    summary, records = _run(tmp_path, privacy__dp__mode="local", privacy__dp__noise_multiplier=2.0)
    for k, r in zip((1, 2, 3), records):   # converted as Balle et al. (2020), at the same orders
        by_hand = min(k * a * 2 / 2.0 ** 2 + math.log1p(-1 / a) - (math.log(1e-5) + math.log(a)) / (a - 1)
                      for a in DEFAULT_ORDERS)
        assert r["dp_epsilon_replace_one"] == pytest.approx(by_hand, rel=1e-12)
        assert r["dp_epsilon_replace_one"] > 2 * r["dp_epsilon"]
    assert summary["dp_epsilon_replace_one"] == records[-1]["dp_epsilon_replace_one"]


def test_central_dp_accounts_subsampled_rounds(tmp_path):
    summary, records = _run(tmp_path, privacy__dp__mode="central", privacy__dp__noise_multiplier=1.0,
                            federate__sample_client_num=3)
    assert records[-1]["dp_epsilon"] == pytest.approx(dp_epsilon(0.5, 1.0, 3, 1e-5))
    assert summary["dp_epsilon"] == records[-1]["dp_epsilon"] and summary["dp_mode"] == "central"


def test_huge_noise_ruins_accuracy_and_no_noise_changes_nothing(tmp_path):
    clean, _ = _run(tmp_path / "a")
    unclipped, _ = _run(tmp_path / "b", privacy__dp__mode="local", privacy__dp__noise_multiplier=0.0,
                        privacy__dp__clip_norm=1e6)
    noisy, _ = _run(tmp_path / "c", privacy__dp__mode="local", privacy__dp__noise_multiplier=50.0)
    assert unclipped["final_test_acc"] == pytest.approx(clean["final_test_acc"])
    assert unclipped["dp_epsilon"] is None  # no noise, no guarantee
    assert noisy["final_test_acc"] < clean["final_test_acc"]


def test_dp_config_errors():
    with pytest.raises(ConfigError, match="privacy.dp.clients and privacy.dp.fraction"):
        small_cfg(None, privacy__dp__mode="local", privacy__dp__clients=[1], privacy__dp__fraction=0.5)
    with pytest.raises(ConfigError, match="central DP .* aggregator.robust_rule"):
        small_cfg(None, privacy__dp__mode="central", aggregator__robust_rule="median")
    # refusing updates by their distance from the others': with one client more, others' clipped
    # updates could be refused, moving the sum by several C
    with pytest.raises(ConfigError, match="admission.norm_ratio: under central DP"):
        small_cfg(None, privacy__dp__mode="central", admission__norm_ratio=10.0)
    small_cfg(None, privacy__dp__mode="central", admission__norm_ratio=float("inf"))   # off: allowed
    small_cfg(None, privacy__dp__mode="local", admission__norm_ratio=10.0)   # after local noise: post-processing
    # FedEx's arm weights come from the clients' un-noised validation losses
    for mode in ("local", "central"):
        with pytest.raises(ConfigError, match="fedex.candidates: FedEx"):
            small_cfg(None, privacy__dp__mode=mode, fedex__candidates=[{"train.optimizer.lr": 0.1},
                                                                        {"train.optimizer.lr": 0.01}])
    with pytest.raises(ConfigError, match="privacy.dp.clients: \\[9\\] are not client ids"):
        Course(small_cfg(None, privacy__dp__mode="local", privacy__dp__clients=[9])).build()


def test_local_dp_clips_fedbuffs_deltas(tmp_path):
    # FedBuff sends deltas (its "model" holds only non-float entries): those must be clipped.
    cfg = small_cfg(tmp_path, algorithm__name="fedbuff", privacy__dp__mode="local",
                    privacy__dp__clip_norm=1e-3, privacy__dp__noise_multiplier=0.0,
                    federate__sample_client_num=1, federate__total_round_num=1, eval__clients=False)
    course = Course(cfg).build()
    before = dict(course.server.aggregator.global_state)
    course.run()
    after = course.server.aggregator.global_state
    moved = torch.cat([(after[k] - before[k]).reshape(-1) for k in before]).norm().item()
    assert 0 < moved <= 1e-3 * (1 + 1e-5)


def test_dp_refuses_algorithms_it_cannot_wrap_at_config_time():
    with pytest.raises(ConfigError, match="local DP cannot wrap algorithm.name scaffold"):
        small_cfg(algorithm__name="scaffold", privacy__dp__mode="local")
    with pytest.raises(ConfigError, match="central DP cannot wrap algorithm.name fedbuff"):
        small_cfg(algorithm__name="fedbuff", privacy__dp__mode="central")
    # FedNova's updates carry their normalizing factor a_i beside the model: a sum of clipped
    # deltas has no place for it (the course stopped at its first aggregation)
    with pytest.raises(ConfigError, match="central DP cannot wrap algorithm.name fednova"):
        small_cfg(algorithm__name="fednova", privacy__dp__mode="central")
    with pytest.raises(ConfigError, match="median cannot be combined with algorithm.name fedbuff"):
        small_cfg(algorithm__name="fedbuff", aggregator__robust_rule="median")


# ---------------------------------------------------------------- central DP on a Poisson sample
def test_poisson_sampler_includes_each_client_independently_with_rate_q():
    sampler = PoissonSampler(list(range(1, 11)), seed=5, rate=0.3)
    draws = [set(sampler.sample(3, list(range(1, 11)))) for _ in range(4000)]
    sizes = [len(d) for d in draws]
    for c in (1, 5, 10):
        assert sum(c in d for d in draws) / 4000 == pytest.approx(0.3, abs=0.03)
    assert sum(1 in d and 2 in d for d in draws) / 4000 == pytest.approx(0.09, abs=0.02)  # q^2
    assert sizes.count(0) / 4000 == pytest.approx(0.7 ** 10, abs=0.015)   # may be empty
    assert sum(sizes) / 4000 == pytest.approx(3.0, abs=0.1)
    again = PoissonSampler(list(range(1, 11)), seed=5, rate=0.3)
    assert [set(again.sample(3, list(range(1, 11)))) for _ in range(50)] == draws[:50]
    secret = [PoissonSampler(list(range(1, 11)), seed=5, rate=0.5, secret=True) for _ in range(2)]
    assert [s.sample(5, list(range(1, 11))) for s in secret for _ in range(20)][:20] != \
        [secret[1].sample(5, list(range(1, 11))) for _ in range(20)]   # OS coins: no seed repeats them


def test_central_dp_samples_by_poisson_and_divides_by_the_expected_cohort(tmp_path):
    summary, records = _run(tmp_path, privacy__dp__mode="central", federate__sample_client_num=3,
                            eval__clients=False)
    sizes = [r["num_updates"] for r in records]
    assert len(set(sizes)) > 1 and all(0 <= m <= 6 for m in sizes)   # the cohort size varies
    assert records[-1]["dp_epsilon"] == pytest.approx(dp_epsilon(0.5, 1.0, 3, 1e-5))
    deltas = [{"w": torch.tensor([3.0, 4.0], dtype=torch.float64)},
              {"w": torch.tensor([0.0, 0.5], dtype=torch.float64)}]
    mean, _ = central_dp_rule(1.0, 0.0, 0, expected=4)(deltas, [1.0, 1.0], [1, 2], 1)
    assert mean["w"].tolist() == pytest.approx([0.6 / 4, 1.3 / 4])   # (clipped sum) / qN


def test_an_empty_sample_still_releases_the_noise_and_is_accounted(tmp_path):
    course = Course(small_cfg(tmp_path, privacy__dp__mode="central", privacy__dp__noise_multiplier=2.0,
                              privacy__dp__clip_norm=0.5, federate__sample_client_num=3,
                              federate__total_round_num=1, eval__clients=False, model__dtype="float64"))
    course.build()
    course.server.sampler.sample = lambda k, candidates: []   # nobody drawn this round
    before = {k: v.clone() for k, v in course.server.aggregator.global_state.items()}
    course.run()
    after = course.server.aggregator.global_state
    names = float_names(before)
    moved = flatten({n: after[n] - before[n] for n in names}, names)
    expected = gaussian_noise(moved.numel(), 2.0 * 0.5, noise_generator(0, 0, 1)) / 3
    assert torch.allclose(moved, expected, rtol=0, atol=1e-12)
    record = course.monitor.records[0]
    assert record["num_updates"] == 0
    assert record["dp_epsilon"] == pytest.approx(dp_epsilon(0.5, 2.0, 1, 1e-5))


@pytest.mark.parametrize("override, needle", [
    ({"asyn__use": True, "asyn__min_received_num": 2}, "synchronous rounds on a Poisson sample"),
    ({"asyn__overselection": True}, "synchronous rounds on a Poisson sample"),
    ({"federate__sampler": "group"}, "central DP samples clients itself"),
    pytest.param({"secure_aggregation__enabled": True, "federate__sample_client_num": 3},
                 "needs every client in every round", marks=pytest.mark.extra("secagg")),
])
def test_central_dp_refuses_samplings_its_bound_does_not_cover(override, needle):
    with pytest.raises(ConfigError, match=needle):
        small_cfg(None, privacy__dp__mode="central", **override)


@pytest.mark.extra("secagg")
def test_central_noise_on_a_secure_sum_is_seeded_in_simulation_and_from_the_os_when_deployed():
    """The server's noise on the unmasked sum: a simulation draws what plain central DP draws from
    the seed; a deployed course draws fresh OS noise, which no client holding the config can regenerate."""
    import torch as _torch
    from fedcore.handlers.secure_aggregation import _central_noise
    model = {"w": _torch.zeros(4, 3), "b": _torch.zeros(3)}
    names = ["b", "w"]                                # the masked vector's order differs from the model's
    sim = small_cfg(None, privacy__dp__mode="central", privacy__dp__noise_multiplier=2.0,
                    secure_aggregation__enabled=True)
    drawn = gaussian_noise(15, 2.0 * 0.5, noise_generator(sim["seed"], 0, 3))
    expected = torch.cat([drawn[12:], drawn[:12]]).numpy()
    assert (_central_noise(model, names, 0.5, sim, 3) == expected).all()
    deployed = small_cfg(None, privacy__dp__mode="central", privacy__dp__noise_multiplier=2.0,
                         secure_aggregation__enabled=True, federate__mode="distributed")
    first, second = _central_noise(model, names, 0.5, deployed, 3), _central_noise(model, names, 0.5, deployed, 3)
    assert not (first == expected).any() and not (first == second).any()


# ---------------------------------------------------------------- clipping inside local training
def _clip_each_step_reference(clip: float, each_step: bool):
    """Client 1 of the drift problem, from THETA0: Algorithm 1's UserUpdateFedAvg projects after
    every step, theta <- theta0 + clip(theta - theta0); the other way clips the final delta."""
    import numpy as np

    from tests import drift_problem as P

    def clipped(theta):
        d = theta - P.THETA0
        return P.THETA0 + d * min(1.0, clip / np.linalg.norm(d))
    theta = P.THETA0.copy()
    for _ in range(P.STEPS):
        theta = theta - P.LR * P.grad(1, theta)
        if each_step:
            theta = clipped(theta)
    return clipped(theta)


def test_central_dp_clips_inside_every_local_step_as_algorithm_1():
    from types import SimpleNamespace

    import numpy as np

    from fedcore.algorithms.dp import _install_projection
    from tests import drift_problem as P
    clip = 0.05
    cfg = P.config("fedavg", privacy__dp__mode="central", privacy__dp__clip_norm=clip,
                   privacy__dp__noise_multiplier=0.0)
    trainer, agg = P.build(cfg)
    _install_projection(SimpleNamespace(trainer=trainer, cfg=cfg))
    sent = P.as_theta(trainer.fit(1, P.client_data(1), agg.broadcast(1), 1).content["model"])
    np.testing.assert_allclose(sent, _clip_each_step_reference(clip, True), rtol=0, atol=1e-12)
    # clipping only the final delta gives another model here (the clip binds before the last step)
    assert np.abs(_clip_each_step_reference(clip, True) - _clip_each_step_reference(clip, False)).max() > 1e-4


@pytest.mark.parametrize("each_step", [True, False])
def test_clip_each_step_is_installed_on_the_clients_trainer_only_when_asked(each_step):
    from fedcore.kernel.hooks import wrappers
    course = Course(small_cfg(None, privacy__dp__mode="central", privacy__dp__clip_each_step=each_step)).build()
    names = [w.behaviour for w in wrappers(course.trainer, "fit")]
    assert ("differential_privacy central (clip each step)" in names) == each_step
    with pytest.raises(ConfigError, match="executor vectorized cannot run behaviour differential_privacy central"):
        Course(small_cfg(None, privacy__dp__mode="central", executor="vectorized")).build()


def test_central_dp_releases_no_entry_it_does_not_noise(tmp_path, caplog):
    # a batch norm's counter (an integer) is not clipped or noised: averaged with the clients'
    # sample counts it would follow their data sizes; it keeps the global model's value
    with caplog.at_level("WARNING", logger="fedcore.dp"):
        course = Course(small_cfg(tmp_path, model__type="mlp_bn", privacy__dp__mode="central",
                                  privacy__dp__noise_multiplier=0.5, data__partition="quantity"))
        course.build()
        before = {n: t.clone() for n, t in course.server.aggregator.global_state.items()
                  if not t.is_floating_point()}
        course.run()
    after = course.server.aggregator.global_state
    assert before and all(torch.equal(after[n], t) for n, t in before.items())
    assert "client evaluations (eval.clients)" in caplog.text   # said: outside the bound
