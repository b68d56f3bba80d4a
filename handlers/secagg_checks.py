"""What a deployed server accepts in secure aggregation's messages, beyond "it decodes": a
hostile or broken client cannot make a stage handler raise (see fedcore/comm/validation.py).
The behaviour declares them (`install.message_checks` in handlers/secure_aggregation.py).
"""
from __future__ import annotations

from typing import Any

import torch

from fedcore.algorithms.secagg_settings import Settings

__all__ = ["MESSAGE_CHECKS"]


def _ints(v: Any, limit: int) -> bool:
    return isinstance(v, list) and len(v) <= limit and all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= limit for x in v)


def _blobs(v: Any, size: int, count: int) -> bool:
    return isinstance(v, list) and len(v) == count and all(isinstance(b, bytes) and len(b) == size for b in v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_keys(content, server) -> str | None:
    if not isinstance(content, dict) or set(content) != {"cipher_key", "mask_key", "weight", "signature"} or \
            not all(isinstance(content[k], bytes) and len(content[k]) == 32 for k in ("cipher_key", "mask_key")) \
            or not _is_int(content["weight"]) or not 1 <= content["weight"] < 2 ** 63 \
            or not isinstance(content["signature"], bytes) or len(content["signature"]) != 64:
        return ("secagg_public_keys content must be {cipher_key, mask_key: 32 bytes each, weight: int >= 1, "
                "signature: 64 bytes}")
    return None


def _check_shares(content, server) -> str | None:
    n = server.course.cfg["federate.client_num"]
    # nonce 12 + ids 8 + two shares 2 * 32 + tag 16
    if not isinstance(content, dict) or set(content) != {"to", "ciphertexts", "signatures", "commitments"} or \
            not _ints(content["to"], n) or not _blobs(content["ciphertexts"], 100, len(content["to"])) or \
            not _blobs(content["signatures"], 64, len(content["to"])) or \
            not isinstance(content["commitments"], bytes) or len(content["commitments"]) % 256 or \
            len(content["commitments"]) > 2 * n * 256:
        return ("secagg_encrypted_shares content must be {to: [client ids], ciphertexts: [100 bytes each], "
                "signatures: [64 bytes each], commitments: 256 bytes each}")
    return None


def _check_masked(content, server) -> str | None:
    s = Settings.of(server.course.cfg)
    masked_length = getattr(server.aggregator, "masked_length", None)
    if masked_length is not None:   # its clients mask another vector than the model (analytics' sums)
        length = masked_length(server.round)
    else:
        model = server.aggregator.broadcast(server.round)["model"]
        length = sum(model[n].numel() for n in s.names(model)) + 1
    ok = isinstance(content, dict) and set(content) == {"masked", "bad_shares"}
    t = content["masked"] if ok else None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (length,) or \
            not _ints(content["bad_shares"], server.course.cfg["federate.client_num"]):
        return f"secagg_masked_input content must be {{masked: int64 tensor of {length}, bad_shares: [client ids]}}"
    if bool((t < 0).any()) or bool((t >= s.modulus).any()):
        return "secagg_masked_input values must lie in the field [0, secure_aggregation.modulus)"
    return None


def _check_signature(content, server) -> str | None:
    if not isinstance(content, dict) or set(content) != {"signature"} or \
            not isinstance(content["signature"], bytes) or len(content["signature"]) != 64:
        return "secagg_survivor_signature content must be {signature: 64 bytes}"
    return None


def _check_unmask(content, server) -> str | None:
    n = server.course.cfg["federate.client_num"]
    pairs = (("seed_ids", "seed_shares"), ("key_ids", "key_shares"), ("pair_ids", "pair_keys"))
    if not isinstance(content, dict) or set(content) != {k for p in pairs for k in p} or \
            not all(_ints(content[i], n) and _blobs(content[v], 32, len(content[i])) for i, v in pairs):
        return ("secagg_unmask_shares content must be {seed_ids, key_ids, pair_ids: [client ids], "
                "seed_shares, key_shares, pair_keys: [32 bytes each]}")
    return None


def _check_abort(content, server) -> str | None:
    if not isinstance(content, dict) or set(content) != {"reason"} or not isinstance(content["reason"], str) \
            or len(content["reason"]) > 200:
        return "secagg_abort content must be {reason: a string of at most 200 characters}"
    return None


MESSAGE_CHECKS = {"secagg_public_keys": _check_keys, "secagg_encrypted_shares": _check_shares,
                  "secagg_masked_input": _check_masked, "secagg_survivor_signature": _check_signature,
                  "secagg_unmask_shares": _check_unmask, "secagg_abort": _check_abort}
