"""DP-FTRL: tree nodes and banded noise by hand, sensitivities by brute force, the limiting
case against SGD on the mean clipped delta, the accounting of a course, and a resume."""
import itertools
import json
import math

import numpy as np
import pytest
import torch

from fedcore.algorithms.dp_accountant import dp_epsilon
from fedcore.algorithms.dp_ftrl import FtrlRelease, Schedule
from fedcore.algorithms.dp_matrix import (BandedNoise, TreeNoise, banded_matrix, banded_sqrt, sensitivity,
                                          tree_matrix, tree_nodes)
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.course import Course
from tests.conftest import small_cfg


def test_each_prefix_sum_gets_the_noise_of_its_binary_decomposition():
    assert tree_nodes(1) == [(1, 1)]
    assert tree_nodes(6) == [(1, 4), (5, 6)]
    assert tree_nodes(7) == [(1, 4), (5, 6), (7, 7)]
    assert tree_nodes(8) == [(1, 8)]
    # node noises z_t (round t draws node [t - lowbit(t) + 1, t]) as powers of ten: the
    # prefix noise is the sum of the increments, and it must be the decomposition's nodes
    stream, prefix, got = TreeNoise(), torch.zeros(1, dtype=torch.float64), []
    for t in range(1, 9):
        prefix = prefix + stream.increment(t, lambda t=t: torch.tensor([10.0 ** (t - 1)], dtype=torch.float64))
        got.append(prefix.item())
    # by hand: 1 <- z1; 2 <- z2; 3 <- z2 + z3; 4 <- z4; 5 <- z4 + z5; 6 <- z4 + z6; 7 <- z4 + z6 + z7; 8 <- z8
    assert got == [1, 10, 110, 1000, 11000, 101000, 1101000, 10000000]
    assert sorted(stream.live) == [(1, 8)]    # what round 9 onwards still needs, nothing more


def test_the_tree_matrix_is_one_node_per_round_and_its_sensitivity_by_hand():
    C = tree_matrix(4)
    assert C.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 1]]
    # one participation: round 1 lies in nodes [1], [1,2], [1,4] -> sqrt(3) (log2 T + 1 levels)
    assert sensitivity(C, 1, 1) == pytest.approx(math.sqrt(3))
    assert sensitivity(tree_matrix(8), 1, 1) == pytest.approx(2.0)
    # twice, 2 apart: rounds {1, 3} give the columns (1,1,0,1) + (0,0,1,1) = (1,1,1,2): sqrt(7)
    assert sensitivity(C, 2, 2) == pytest.approx(math.sqrt(7))
    # every round: ||C 1||^2 = sum of the node sizes squared = 1 + 4 + 1 + 16 + 1 + 4 + 1 + 64
    assert sensitivity(tree_matrix(8), 8, 1) == pytest.approx(math.sqrt(92))


def _brute_force(C, k, b):
    X, best = np.abs(C.T @ C), 0.0
    for r in range(1, k + 1):
        for P in itertools.combinations(range(C.shape[1]), r):
            if all(y - x >= b for x, y in zip(P, P[1:])):
                best = max(best, X[np.ix_(P, P)].sum())
    return math.sqrt(best)


@pytest.mark.parametrize("k, b", [(2, 2), (3, 2), (2, 3), (4, 1), (3, 3)])
def test_the_sensitivity_bound_holds_and_is_exact_where_documented(k, b):
    for C in (tree_matrix(8), banded_sqrt(8, 3)):
        assert sensitivity(C, k, b) >= _brute_force(C, k, b) - 1e-12      # an upper bound
    assert sensitivity(tree_matrix(8), k, b) == pytest.approx(_brute_force(tree_matrix(8), k, b), rel=1e-12)
    if b >= 3:   # the band (3 wide) no wider than the separation: sqrt(k) max column norm
        assert sensitivity(banded_sqrt(8, 3), k, b) == pytest.approx(math.sqrt(k), rel=1e-12)


def test_the_banded_factorization_beats_its_start_and_the_tree():
    T, bands = 12, 3
    C = banded_matrix(T, bands)
    assert np.allclose(np.linalg.norm(C, axis=0), 1.0) and np.allclose(np.triu(C, 1), 0)
    assert np.allclose(np.tril(C, -bands), 0)
    A = np.tril(np.ones((T, T)))
    error = lambda M: np.linalg.norm(A @ np.linalg.inv(M)) ** 2 * sensitivity(M, 4, 3) ** 2  # noqa: E731
    assert error(C) < error(banded_sqrt(T, bands)) < error(tree_matrix(T))
    # a band no wider than the separation: sqrt(participations) x a column's norm (= 1)
    assert sensitivity(C, 4, 3) == pytest.approx(2.0)


def test_banded_noise_increments_sum_to_the_decoder_applied_to_z():
    C = banded_matrix(6, 2)
    z = torch.randn(6, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    stream, prefix = BandedNoise(C, 2), torch.zeros(3, dtype=torch.float64)
    expected = np.tril(np.ones((6, 6))) @ np.linalg.inv(C) @ z.numpy()   # B Z = A C^-1 Z
    for t in range(1, 7):
        prefix = prefix + stream.increment(t, lambda t=t: z[t - 1])
        assert prefix.numpy() == pytest.approx(expected[t - 1], rel=1e-10, abs=1e-12)
    assert len(stream.recent) == 1


def test_a_release_moves_the_model_by_the_clipped_sum_and_the_nodes_noise():
    cfg = small_cfg(privacy__dp__mode="ftrl", federate__client_num=4, federate__sample_client_num=2,
                    federate__total_round_num=4, privacy__dp__noise_multiplier=0.5,
                    privacy__dp__clip_norm=1.0, privacy__dp__ftrl__lr=0.3)
    release = FtrlRelease(cfg, 4, lambda t: torch.Generator().manual_seed(100 + t))
    assert release.sens == pytest.approx(math.sqrt(7)) and release.m == 2.0
    z = {t: torch.randn(2, generator=torch.Generator().manual_seed(100 + t), dtype=torch.float64) for t in (1, 2, 3)}
    deltas = {1: [[3.0, 4.0], [0.0, 0.5]], 2: [[0.0, 2.0], [0.1, 0.0]], 3: [[0.6, 0.8], [-3.0, 0.0]]}
    clients = {1: [1, 2], 2: [3, 4], 3: [1, 2]}
    moved = torch.zeros(2, dtype=torch.float64)
    for t in (1, 2, 3):
        d = [{"w": torch.tensor(v, dtype=torch.float64)} for v in deltas[t]]
        step, metrics = release.rule(d, [1.0, 1.0], clients[t], t)
        moved += step["w"]
    clipped = [[0.6, 0.8], [0.0, 0.5], [0.0, 1.0], [0.1, 0.0], [0.6, 0.8], [-1.0, 0.0]]   # by hand
    g = torch.tensor(clipped, dtype=torch.float64).sum(0)
    std = 0.5 * 1.0 * math.sqrt(7)
    # after 3 releases the prefix noise is that of nodes [1, 2] and [3, 3]: z2 + z3
    assert moved.tolist() == pytest.approx((0.3 / 2 * (g + std * (z[2] + z[3]))).tolist(), rel=1e-12)
    assert metrics == {"dp_clipped": 1, "dp_ftrl_dropped": 0}


def test_a_client_beyond_its_schedule_is_dropped():
    s = Schedule(k=2, b=3)
    assert s.admits(7, 1) and not s.admits(7, 3) and s.admits(7, 4) and not s.admits(7, 8)


def _final(path):
    return torch.load(path / "final_model.pt", weights_only=True)


def _records(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("factorization", ["tree", "banded"])
def test_without_noise_ftrl_is_sgd_on_the_mean_clipped_delta(tmp_path, factorization):
    common = dict(model__dtype="float64", federate__total_round_num=3, eval__clients=False,
                  privacy__dp__noise_multiplier=0.0, privacy__dp__clip_norm=0.05)
    Course(small_cfg(tmp_path / "ftrl", privacy__dp__mode="ftrl", privacy__dp__ftrl__lr=0.5,
                     privacy__dp__ftrl__factorization=factorization, **common)).run()
    Course(small_cfg(tmp_path / "sgd", privacy__dp__mode="central", server_optimizer__type="sgd",
                     server_optimizer__lr=0.5, **common)).run()
    a, b = _final(tmp_path / "ftrl"), _final(tmp_path / "sgd")
    assert all(torch.allclose(a[k], b[k], rtol=1e-12, atol=1e-14) for k in a)
    assert all(r["server_update_norm"] > 0 for r in _records(tmp_path / "sgd"))   # the steps were taken


def test_a_course_asks_groups_in_turn_and_accounts_each_prefix(tmp_path):
    sigma = 2.0
    summary = Course(small_cfg(tmp_path, privacy__dp__mode="ftrl", federate__client_num=4,
                               federate__sample_client_num=2, federate__total_round_num=4,
                               privacy__dp__noise_multiplier=sigma, eval__clients=False)).run()
    rows = _records(tmp_path)
    assert [r["num_updates"] for r in rows] == [2, 2, 2, 2] and all(r["dp_ftrl_dropped"] == 0 for r in rows)
    # prefix sensitivities by hand (see the tree test): 1, sqrt 2, sqrt 3, sqrt 7; noise sigma sqrt 7
    expected = [dp_epsilon(1.0, sigma * math.sqrt(7) / s, 1, 1e-5) for s in (1, math.sqrt(2), math.sqrt(3), math.sqrt(7))]
    assert [r["dp_epsilon"] for r in rows] == pytest.approx(expected, rel=1e-9)
    assert summary["dp_ftrl_sensitivity"] == pytest.approx(math.sqrt(7))
    assert summary["dp_ftrl_max_participations"] == 2 and summary["dp_ftrl_min_separation"] == 2


def test_a_resumed_course_continues_the_same_noise(tmp_path):
    common = dict(privacy__dp__mode="ftrl", federate__sample_client_num=2, federate__total_round_num=4,
                  privacy__dp__noise_multiplier=1.0, eval__clients=False)
    Course(small_cfg(tmp_path / "full", checkpoint__every=2, **common)).run()
    ckpt = tmp_path / "full" / "checkpoints" / "round_2.pt"
    Course(small_cfg(tmp_path / "resumed", resume_from=str(ckpt), **common)).run()
    a, b = _final(tmp_path / "full"), _final(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    longer = {**common, "federate__total_round_num": 6}
    with pytest.raises(ConfigError, match="federate.total_round_num: the snapshot's DP-FTRL noise is for 4"):
        Course(small_cfg(tmp_path / "longer", resume_from=str(ckpt), **longer)).run()


@pytest.mark.parametrize("overrides, match", [
    (dict(server_optimizer__type="adam"), "server_optimizer.type: DP-FTRL"),
    (dict(asyn__use=True), "asyn.use: DP-FTRL"),
    (dict(aggregator__robust_rule="median"), "aggregator.robust_rule"),
])
def test_what_ftrl_cannot_cover_is_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        small_cfg(privacy__dp__mode="ftrl", **overrides)
