"""What a server accepts from the network, beyond "it decodes".

Decoding already refuses anything outside the allowed content types. These
checks refuse well-typed content of the wrong shape for its message type, so
a hostile or broken peer cannot make a handler raise (which would stop the
course): an update must carry exactly what its course declares, by default
the global model's shared entries with their shapes and dtypes, finite values
and a sample count. The declaration is the course's: its algorithm's
`update_layout` (`fedcore.kernel.contract.Algorithm`), changed by each of its
behaviours that declares one (`install.update_layout`: compression's encoded
maps, FedEx's feedback); a behaviour that adds message types declares their
checks (`install.message_checks`: secure aggregation's protocol messages); a vertical course's
parties' messages are checked by `vertical_message_checks` (handlers/vertical_deploy.py).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from fedcore.kernel import registry
from fedcore.wire.tensor_forms import first_nonfinite, get_form

__all__ = ["CHECKS", "check_content", "check_join_in", "check_updates", "check_metrics", "model_layout",
           "update_layout", "first_nonfinite", "MAX_METRICS", "MAX_METRIC_NAME"]

MAX_METRICS = 64        # entries in one metrics message
MAX_METRIC_NAME = 64    # characters of a metric's name
RESERVED_METRICS = frozenset({"round", "client"})   # what a late evaluation line says of itself

Check = Callable[[Any, Any], "str | None"]  # (content, server worker) -> problem or None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_join_in(content: Any, server) -> str | None:
    if content is None:
        return None
    if not isinstance(content, dict) or set(content) - {"client_id", "num_samples", "state_round"}:
        return "join_in content must be {client_id: int, num_samples: int, state_round: int}"
    if "client_id" in content and not _is_int(content["client_id"]):
        return "join_in client_id must be an int"
    if "num_samples" in content and (not _is_int(content["num_samples"]) or content["num_samples"] < 0):
        return "join_in num_samples must be a non-negative int"
    if "state_round" in content and (not _is_int(content["state_round"]) or content["state_round"] < -1):
        return "join_in state_round must be an int >= -1"
    return None


def model_layout(server) -> dict[str, dict[str, torch.Tensor]]:
    """The default update: the global model's shared entries under 'model'."""
    return {"model": server.aggregator.broadcast(server.round).get("model", {})}


def _check_map(key: str, got: Any, expected: dict[str, torch.Tensor]) -> str | None:
    if not isinstance(got, dict):
        return f"update entry '{key}' must be a map of tensors"
    if set(got) != set(expected):
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        what = "model" if key == "model" else f"'{key}'"
        return f"update's {what} entries differ from the global model's (missing {missing}, extra {extra})"
    for name, t in got.items():
        ref = expected[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            got_s = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            where = name if key == "model" else f"{key}.{name}"
            return f"update entry '{where}' is {got_s}, expected {tuple(ref.shape)} {ref.dtype}"
        if not _TORCH.all_finite(t):
            where = name if key == "model" else f"{key}.{name}"
            return f"update entry '{where}' has non-finite values"
    return None


_TORCH = get_form("torch")


def update_layout(server) -> dict[str, Any]:
    """What an update must carry in `server`'s course (`fedcore.kernel.contract.UpdateLayout`): its
    algorithm's declared layout, as each of its behaviours declares a change to it."""
    course = _course(server)
    if course is None:          # a bare server object: no course, no declarations
        return model_layout(server)
    algorithm = registry.algorithms.get(course.cfg["algorithm.name"])
    layout = (algorithm.update_layout or model_layout)(server)
    for change in _declared(course.cfg, "update_layout"):
        layout = change(server, layout)
    return layout


def _course(server):
    return getattr(server, "course", None)


def _declared(cfg, what: str) -> list:
    """What the course's behaviours declare under `what`, in their order."""
    found = (getattr(registry.behaviours.get(n), what, None) for n in registry.selected_behaviours(cfg))
    return [d for d in found if d is not None]


def check_updates(content: Any, server) -> str | None:
    layout = update_layout(server)
    if not isinstance(content, dict) or ("model" in layout and not isinstance(content.get("model"), dict)):
        keys = " and ".join(f"a '{k}' map" for k in layout)
        return f"updates content must be a map with {keys} of tensors"
    if not _is_int(content.get("num_samples")) or content["num_samples"] < 0:
        return "updates content needs 'num_samples', a non-negative int"
    missing = [k for k in layout if k not in content]
    if missing:
        kind = "entry" if callable(layout[missing[0]]) else "map of tensors"
        return f"updates content needs a '{missing[0]}' {kind}"
    extra = sorted(set(content) - set(layout) - {"num_samples"})
    if extra:
        return (f"updates content has unexpected entries {extra[:3]} "
                f"(expected {sorted(layout)} and num_samples)")
    for key, expected in layout.items():
        problem = expected(content[key], server) if callable(expected) else \
            _check_map(key, content[key], expected)
        if problem:
            return problem
    return None


def check_metrics(content: Any, server) -> str | None:
    if content is None:
        return None
    if not isinstance(content, dict):
        return "metrics content must be a map of numbers"
    if len(content) > MAX_METRICS:
        return f"metrics content has {len(content)} entries, more than {MAX_METRICS}"
    for k, v in content.items():
        if len(k) > MAX_METRIC_NAME:
            return f"metric name of {len(k)} characters, more than {MAX_METRIC_NAME}"
        if k in RESERVED_METRICS:   # the server's own fields of a record: a client cannot set them
            return f"metric name '{k}' is reserved for the server's record"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"metric '{k[:MAX_METRIC_NAME]}' is not a number"
    return None


# the built-in message types' checks (read-only: others are declared by the behaviours adding them)
CHECKS: Mapping[str, Check] = MappingProxyType({
    "join_in": check_join_in,
    "updates": check_updates,
    "metrics": check_metrics,
})


def check_content(msg_type: str, content: Any, server) -> str | None:
    """The problem with `content` for `msg_type`, or None when it may be handled."""
    check = CHECKS.get(msg_type)
    if check is None:
        course = _course(server)
        declared = _declared(course.cfg, "message_checks") if course is not None else []
        if course is not None and course.cfg["data.partition"] == "vertical":   # the parties' messages
            declared.append(registry.components.get("vertical_message_checks"))
        check = next((checks[msg_type] for checks in declared if msg_type in checks), None)
    return check(content, server) if check is not None else None
