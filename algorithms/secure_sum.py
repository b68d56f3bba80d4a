"""The server's half of secure aggregation: from masked inputs and revealed shares to the
unmasked sum, and from the sum to the next global model.

`unmask` removes every mask the protocol leaves in the sum of the surviving
clients' masked inputs: each survivor's self mask PRG(b_v) (b_v rebuilt from its
neighbours' shares) and, for each client that dropped after sharing, the
pairwise masks its surviving neighbours added (its mask key rebuilt from
shares, the pair key re-derived by X25519). What is left is
sum_k w_k q_k and W = sum_k w_k, nothing per client.

`unmasked_update` is the one point where that sum becomes the aggregate:
dequantized to the weighted mean delta (plus central DP noise, when on), it
reaches the algorithm's aggregator as a single update carrying
`global + mean delta` with weight W. An aggregator (or a server optimizer it
calls) therefore only ever sees the unmasked weighted mean.
"""
from __future__ import annotations

import numpy as np
import torch

from fedcore.contract import ReceivedUpdate
from fedcore.shamir import combine

__all__ = ["MASK_INFO", "mask_sign", "pair_mask", "unmask", "mean_delta", "unmasked_update",
           "ShareShortage"]

MASK_INFO = b"fedcore secagg pairwise mask"
SEED_BYTES = 32


class ShareShortage(Exception):
    """Fewer shares than the threshold came back for some secret: the sum cannot be unmasked."""


def mask_sign(u: int, v: int) -> int:
    """Client u adds +PRG(s_uv) when u < v and -PRG(s_uv) when u > v, so each pair cancels."""
    return 1 if u < v else -1


def pair_mask(private, peer_public: bytes, length: int, modulus: int) -> np.ndarray:
    from fedcore.algorithms.secagg_crypto import agree, prg_field
    return prg_field(agree(private, peer_public, MASK_INFO), length, modulus)


def unmask(masked: dict[int, np.ndarray], dropped: list[int], mask_neighbours: dict[int, list[int]],
           mask_keys: dict[int, bytes], seed_shares: dict[int, dict[int, int]],
           key_shares: dict[int, dict[int, int]], threshold: int, modulus: int) -> np.ndarray:
    """sum_k x_k mod p over the survivors (`masked`), every mask removed.

    `mask_neighbours[v]`: the clients v exchanged pairwise masks with; `mask_keys[v]`: v's
    public mask key; `seed_shares[v]` / `key_shares[v]`: holder -> Shamir share of v's
    self-mask seed (survivors) / mask private key (dropped clients)."""
    from fedcore.algorithms.secagg_crypto import field_add, field_sub, prg_field
    length = next(iter(masked.values())).size
    total = np.zeros(length, dtype=np.uint64)
    for v in sorted(masked):
        total = field_add(total, masked[v], modulus)
    for v in sorted(masked):
        shares = seed_shares.get(v, {})
        if len(shares) < threshold:
            raise ShareShortage(f"client {v}'s self-mask seed: {len(shares)} of {threshold} shares")
        seed = combine(shares, threshold, SEED_BYTES)
        total = field_sub(total, prg_field(seed, length, modulus), modulus)
    for v in sorted(dropped):
        shares = key_shares.get(v, {})
        if len(shares) < threshold:
            raise ShareShortage(f"dropped client {v}'s mask key: {len(shares)} of {threshold} shares")
        private = combine(shares, threshold, SEED_BYTES)
        for u in mask_neighbours.get(v, []):
            if u not in masked:
                continue   # u dropped too: it never sent the mask
            mask = pair_mask(private, mask_keys[u], length, modulus)
            total = field_sub(total, mask, modulus) if mask_sign(u, v) > 0 else field_add(total, mask, modulus)
    return total


def mean_delta(total: np.ndarray, clip: float, bits: int) -> tuple[np.ndarray, int]:
    """(weighted mean of the clients' deltas, W) from an unmasked sum whose last entry is W."""
    from fedcore.algorithms.secagg_crypto import dequantize
    weight = int(total[-1])
    if weight <= 0:
        raise ValueError("the unmasked total weight is zero")
    return dequantize(total[:-1], weight, clip, bits), weight


def unmasked_update(aggregator, mean: np.ndarray, weight: int, names: list[str],
                    contributors: list[int], round_: int) -> ReceivedUpdate:
    """The one update the aggregator receives: the global model plus the unmasked mean delta,
    weighted W. This is where the unmasked weighted sum becomes the aggregate; whatever the
    aggregator does after its weighted mean (server momentum, an outer optimizer) applies.

    Entries outside `names` (integer buffers such as BatchNorm counters) keep their global
    value: only floating entries travel masked. `contributors` (the survivors) lets
    per-client bookkeeping (local DP's ledger) count who is in the sum."""
    base = aggregator.global_state
    vec = torch.from_numpy(mean)
    deltas, pos = {}, 0
    for n in names:  # the clients' flattening order
        t = base[n]
        deltas[n] = vec[pos:pos + t.numel()].reshape(t.shape)
        pos += t.numel()
    model = {}
    for n in aggregator.broadcast(round_)["model"]:
        t = base[n]
        model[n] = (t.to(torch.float64) + deltas[n]).to(t.dtype) if n in deltas else t.clone()
    one = ReceivedUpdate(contributors[0] if contributors else 0, {"model": model, "num_samples": weight},
                         round_, 0)
    one.contributors = list(contributors)
    return one
