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

import math

import numpy as np
import torch

from fedcore.kernel.contract import ReceivedUpdate
from fedcore.kernel.shamir import combine

__all__ = ["MASK_INFO", "mask_sign", "pair_key", "pair_mask", "unmask", "mean_delta", "unmasked_update",
           "ShareShortage", "out_of_range", "norm_reach", "beyond_norm"]

MASK_INFO = b"fedcore secagg pairwise mask"
SEED_BYTES = 32


class ShareShortage(Exception):
    """Fewer shares than the threshold came back for some secret: the sum cannot be unmasked."""


def mask_sign(u: int, v: int) -> int:
    """Client u adds +PRG(s_uv) when u < v and -PRG(s_uv) when u > v, so each pair cancels."""
    return 1 if u < v else -1


def pair_key(private, peer_public: bytes) -> bytes:
    """The seed of the pairwise mask of a pair: HKDF(X25519(one's mask key, the other's))."""
    from fedcore.algorithms.secagg_crypto import agree
    return agree(private, peer_public, MASK_INFO)


def pair_mask(private, peer_public: bytes, length: int, modulus: int) -> np.ndarray:
    from fedcore.algorithms.secagg_crypto import prg_field
    return prg_field(pair_key(private, peer_public), length, modulus)


def unmask(masked: dict[int, np.ndarray], dropped: dict[int, list[int]], mask_keys: dict[int, bytes],
           seed_shares: dict[int, dict[int, int]], key_shares: dict[int, dict[int, int]],
           pair_keys: dict[int, dict[int, bytes]], threshold: int, modulus: int) -> np.ndarray:
    """sum_k x_k mod p over the survivors (`masked`), every mask removed.

    `dropped[v]`: the survivors that masked their input with v, a client outside the sum;
    `mask_keys[v]`: v's public mask key; `seed_shares[v]`: holder -> Shamir share of
    survivor v's self-mask seed; `key_shares[v]`: holder -> share of dropped v's mask key;
    `pair_keys[v]`: survivor u -> the pairwise mask key u revealed for dropped v. Shares are
    taken as checked (Feldman) by the caller. A dropped client's key rebuilt from t shares
    removes all its masks if it matches its public key; otherwise each survivor's revealed
    pairwise key does."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from fedcore.algorithms.secagg_crypto import field_add, field_sub, prg_field, public_bytes
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
        private = None
        if len(key_shares.get(v, {})) >= threshold:
            private = X25519PrivateKey.from_private_bytes(combine(key_shares[v], threshold, SEED_BYTES))
            if public_bytes(private) != mask_keys.get(v):
                private = None   # v shared a key other than the one it advertised
        for u in dropped[v]:
            if private is not None:
                seed = pair_key(private, mask_keys[u])
            elif u in pair_keys.get(v, {}):
                seed = pair_keys[v][u]
            else:
                raise ShareShortage(f"dropped client {v}'s mask with client {u}: neither {threshold} "
                                    "key shares matching its public key nor the pair's key")
            mask = prg_field(seed, length, modulus)
            total = field_sub(total, mask, modulus) if mask_sign(u, v) > 0 else field_add(total, mask, modulus)
    return total


def out_of_range(total: np.ndarray, weight: int, bits: int) -> str | None:
    """Why an unmasked sum is not one honest inputs can reach, or None: its weight entry must be
    the declared total `weight`, and each coordinate at most weight * (2^bits - 1)."""
    if int(total[-1]) != weight:
        return f"its total weight is {int(total[-1])}, the survivors declared {weight}"
    top = int(total[:-1].max()) if total.size > 1 else 0
    if top > weight * ((1 << bits) - 1):
        return f"a coordinate is {top}, above the {weight * ((1 << bits) - 1)} that weight {weight} allows"
    return None


def norm_reach(clip_norm: float, length: int, clip: float, bits: int) -> float:
    """The largest L2 norm a mean of honest inputs can have when each client clipped its delta to
    L2 norm `clip_norm` (central DP) before quantizing: each dequantized delta is its clipped
    delta (norm <= clip_norm; clipping to [-c, c] only shortens it) plus a rounding error of at
    most c / (2^bits - 1) per coordinate, and a mean is no longer than its longest term."""
    return clip_norm + math.sqrt(length) * clip / ((1 << bits) - 1)


def beyond_norm(mean: np.ndarray, clip_norm: float, clip: float, bits: int) -> str | None:
    """Why a mean delta of clients that each clipped to L2 norm `clip_norm` is not one honest
    inputs can reach (`norm_reach`, with a float64 rounding margin), or None."""
    reach = norm_reach(clip_norm, mean.size, clip, bits)
    norm = float(np.linalg.norm(mean))
    if norm > reach * (1 + 1e-9):
        return f"the mean delta's L2 norm is {norm:.6g}, above the {reach:.6g} that clip_norm {clip_norm:g} allows"
    return None


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
