"""LoRA aggregation: the exact aggregate is the weighted mean of the clients' B A products.

Why the expected values hold: the mean Σ w_i B_i A_i / Σ w_i is a sum of matrices of rank at
most r_i, so its rank is at most Σ r_i; a rank-r SVD factorization with r ≥ Σ r_i therefore
loses nothing (B A equals the mean to rounding). With r < Σ r_i the factorization is the best
rank-r approximation (Eckart–Young): its Frobenius error is the norm of the dropped singular
values of the mean, which numpy computes here independently. Averaging A and B separately
gives mean(B) mean(A), which differs from the mean of the products by the cross terms.
"""
import numpy as np
import pytest
import torch

from fedcore.algorithms.lora import exact_lora_mean, truncate_rank


def _clients(ranks, d_out=12, d_in=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g)) for r in ranks]


def _mean_of_products(factors, weights):
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    return sum(wi * (b.double().numpy() @ a.double().numpy()) for (a, b), wi in zip(factors, w))


@pytest.mark.parametrize("ranks", [[1, 2, 3], [4, 4], [2, 1, 1, 3]])
def test_exact_aggregate_equals_the_weighted_mean_of_products_with_heterogeneous_ranks(ranks):
    factors, weights = _clients(ranks), [3.0, 1.0, 2.0, 5.0][:len(ranks)]
    r = sum(ranks)                                   # the global rank holds every client's update
    # clients of lower rank send the global shape, zero beyond their rank (as in a course)
    padded = [(torch.cat([a, torch.zeros(r - len(a), a.shape[1])]),
               torch.cat([b, torch.zeros(b.shape[0], r - b.shape[1])], 1)) for a, b in factors]
    a, b = exact_lora_mean(padded, weights, r)
    assert a.shape == (r, 10) and b.shape == (12, r)
    expected = _mean_of_products(factors, weights)
    assert np.abs((b @ a).double().numpy() - expected).max() < 1e-6
    # A's rows are orthonormal (the magnitude sits in B = U S)
    assert torch.allclose(a @ a.T, torch.eye(r), atol=1e-5)


def test_exact_aggregate_below_the_sum_of_ranks_is_the_best_rank_r_approximation():
    factors, weights = _clients([3, 3]), [1.0, 2.0]
    a, b = exact_lora_mean(factors, weights, 4)      # 4 < 3 + 3
    mean = _mean_of_products(factors, weights)
    s = np.linalg.svd(mean, compute_uv=False)
    error = np.linalg.norm((b @ a).double().numpy() - mean)
    assert error == pytest.approx(np.sqrt(np.sum(s[4:] ** 2)), rel=1e-5)


def test_separate_averaging_is_not_the_mean_of_the_updates():
    factors, weights = _clients([2, 2]), [1.0, 1.0]
    mean_a = (factors[0][0] + factors[1][0]) / 2
    mean_b = (factors[0][1] + factors[1][1]) / 2
    gap = np.abs((mean_b @ mean_a).double().numpy() - _mean_of_products(factors, weights)).max()
    assert gap > 0.1                                  # the cross terms B_1 A_2 + B_2 A_1 remain


def test_truncating_to_a_client_rank_keeps_the_leading_components_only():
    a, b = exact_lora_mean(_clients([2, 2]), [1.0, 1.0], 4)
    state = truncate_rank({"x.lora_A.w": a, "x.lora_B.w": b}, [("x.lora_A.w", "x.lora_B.w")], 2)
    assert torch.equal(state["x.lora_A.w"][:2], a[:2]) and not state["x.lora_A.w"][2:].any()
    assert torch.equal(state["x.lora_B.w"][:, :2], b[:, :2]) and not state["x.lora_B.w"][:, 2:].any()
    assert a[2:].any()                                # the global factors are left as they were
