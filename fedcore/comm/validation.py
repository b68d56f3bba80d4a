"""What a server accepts from the network, beyond "it decodes".

Decoding already refuses anything outside the allowed content types. These
checks refuse well-typed content of the wrong shape for its message type, so
a hostile or broken peer cannot make a handler raise (which would stop the
course): an update must carry exactly the global model's shared entries, with
their shapes and dtypes, finite values and a sample count. Algorithms that
send more may register a check for their own message types in `CHECKS`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["CHECKS", "check_content", "check_join_in", "check_updates", "check_metrics"]

Check = Callable[[Any, Any], "str | None"]  # (content, server worker) -> problem or None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_join_in(content: Any, server) -> str | None:
    if content is None:
        return None
    if not isinstance(content, dict) or set(content) - {"client_id"}:
        return "join_in content must be {client_id: int}"
    if "client_id" in content and not _is_int(content["client_id"]):
        return "join_in client_id must be an int"
    return None


def check_updates(content: Any, server) -> str | None:
    if not isinstance(content, dict) or not isinstance(content.get("model"), dict):
        return "updates content must be a map with a 'model' map of tensors"
    if not _is_int(content.get("num_samples")) or content["num_samples"] < 0:
        return "updates content needs 'num_samples', a non-negative int"
    expected = server.aggregator.broadcast(server.round).get("model", {})
    model = content["model"]
    if set(model) != set(expected):
        missing = sorted(set(expected) - set(model))[:3]
        extra = sorted(set(model) - set(expected))[:3]
        return f"update's model entries differ from the global model's (missing {missing}, extra {extra})"
    for name, t in model.items():
        ref = expected[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"update entry '{name}' is {got}, expected {tuple(ref.shape)} {ref.dtype}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"update entry '{name}' has non-finite values"
    return None


def check_metrics(content: Any, server) -> str | None:
    if content is None:
        return None
    if not isinstance(content, dict):
        return "metrics content must be a map of numbers"
    for k, v in content.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"metric '{k}' is not a number"
    return None


CHECKS: dict[str, Check] = {
    "join_in": check_join_in,
    "updates": check_updates,
    "metrics": check_metrics,
}


def check_content(msg_type: str, content: Any, server) -> str | None:
    """The problem with `content` for `msg_type`, or None when it may be handled."""
    check = CHECKS.get(msg_type)
    return check(content, server) if check is not None else None
