"""What a deployed server accepts in secure aggregation's messages, beyond "it decodes": a
hostile or broken client cannot make a stage handler raise (see fedcore/comm/validation.py).
"""
from __future__ import annotations

from typing import Any

import torch

from fedcore.algorithms.secagg_settings import Settings
from fedcore.comm.validation import CHECKS

__all__ = ["CHECKS"]


def _ints(v: Any, limit: int) -> bool:
    return isinstance(v, list) and len(v) <= limit and all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= limit for x in v)


def _blobs(v: Any, size: int, count: int) -> bool:
    return isinstance(v, list) and len(v) == count and all(isinstance(b, bytes) and len(b) == size for b in v)


def _check_keys(content, server) -> str | None:
    if not isinstance(content, dict) or set(content) != {"cipher_key", "mask_key"} or \
            not all(isinstance(v, bytes) and len(v) == 32 for v in content.values()):
        return "secagg_public_keys content must be {cipher_key, mask_key}: 32 bytes each"
    return None


def _check_shares(content, server) -> str | None:
    n = server.course.cfg["federate.client_num"]
    # nonce 12 + ids 8 + two shares 2 * 66 + tag 16
    if not isinstance(content, dict) or set(content) != {"to", "ciphertexts"} or \
            not _ints(content["to"], n) or not _blobs(content["ciphertexts"], 168, len(content["to"])):
        return "secagg_encrypted_shares content must be {to: [client ids], ciphertexts: [168 bytes each]}"
    return None


def _check_masked(content, server) -> str | None:
    s = Settings.of(server.course.cfg)
    model = server.aggregator.broadcast(server.round)["model"]
    length = sum(model[n].numel() for n in s.names(model)) + 1
    t = content.get("masked") if isinstance(content, dict) and set(content) == {"masked"} else None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (length,):
        return f"secagg_masked_input content must be {{masked: int64 tensor of {length}}}"
    if bool((t < 0).any()) or bool((t >= s.modulus).any()):
        return "secagg_masked_input values must lie in the field [0, secure_aggregation.modulus)"
    return None


def _check_unmask(content, server) -> str | None:
    n = server.course.cfg["federate.client_num"]
    if not isinstance(content, dict) or set(content) != {"ids", "shares"} or \
            not _ints(content["ids"], n) or not _blobs(content["shares"], 66, len(content["ids"])):
        return "secagg_unmask_shares content must be {ids: [client ids], shares: [66 bytes each]}"
    return None


CHECKS.update({"secagg_public_keys": _check_keys, "secagg_encrypted_shares": _check_shares,
               "secagg_masked_input": _check_masked, "secagg_unmask_shares": _check_unmask})
