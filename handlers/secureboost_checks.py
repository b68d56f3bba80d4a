"""What a passive SecureBoost party may send to a deployed active party, checked on the wire
(fedcore/comm/validation.py, with the vertical course's own checks) so that a malformed message
is refused before a handler reads it. What is well formed but not what was asked (a histogram
of the wrong size, rows for a node not asked) is the handlers' to refuse (handlers/secureboost.py).
"""
from __future__ import annotations

from fedcore.handlers import vertical_deploy  # noqa: F401  (registers the checks extended here)
from fedcore.kernel.registry import components

__all__ = ["MESSAGE_CHECKS"]
def _int_vector(t, what: str, dtype=None) -> str | None:
    import torch
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != (dtype or torch.int64):
        return f"{what} must be a 1-d {dtype or torch.int64} tensor"
    return None


def _state(active, what: str):
    sb = getattr(active, "sb", None)
    return sb, (None if sb is not None else f"{what} before the active party's key was sent")


def check_bins(content, active) -> str | None:
    """`sb_bins`: each own feature's bin count, 1..max_bin + 1 (the cuts a sketch can give)."""
    if not isinstance(content, dict) or set(content) != {"bins"}:
        return "sb_bins content must be {bins: int64 tensor}"
    top = active.course.cfg["trees.max_bin"] + 1
    problem = _int_vector(content["bins"], "sb_bins bins")
    if problem is None and not bool(((content["bins"] >= 1) & (content["bins"] <= top)).all()):
        return f"sb_bins bins must lie in 1..{top}"
    return problem


def check_histograms(content, active) -> str | None:
    """`sb_histograms`: one ciphertext below n^2 of the key's width per open node, own feature,
    own bin and g/h."""
    sb, problem = _state(active, "sb_histograms")
    if problem:
        return problem
    if not isinstance(content, dict) or set(content) != {"c"} or not isinstance(content["c"], list):
        return "sb_histograms content must be {c: [ciphertexts]}"
    width = ((sb.n * sb.n).bit_length() + 7) // 8
    if any(not isinstance(x, bytes) or len(x) != width for x in content["c"]):
        return f"sb_histograms c must hold {width}-byte ciphertexts"
    return None


def check_left(content, active) -> str | None:
    """`sb_left`: for each node the party was asked to split, which aligned rows go left."""
    import torch
    sb, problem = _state(active, "sb_left")
    if problem:
        return problem
    if not isinstance(content, dict) or set(content) != {"nodes", "left"}:
        return "sb_left content must be {nodes: int64 tensor, left: bool tensor}"
    problem = _int_vector(content["nodes"], "sb_left nodes")
    if problem:
        return problem
    left, shape = content["left"], (len(content["nodes"]), len(sb.y))
    if not isinstance(left, torch.Tensor) or left.dtype != torch.bool or tuple(left.shape) != shape:
        return f"sb_left left must be a bool tensor of {shape[0]} x {shape[1]}"
    return None


def check_reveal(content, active) -> str | None:
    """`sb_reveal`: a finite threshold for each split the party was asked, in that order, and
    each test row's direction there."""
    import torch
    sb, problem = _state(active, "sb_reveal")
    if problem:
        return problem
    if not isinstance(content, dict) or set(content) != {"thresholds", "test_left"}:
        return "sb_reveal content must be {thresholds: float64 tensor, test_left: bool tensor}"
    th, tl = content["thresholds"], content["test_left"]
    tests = len(active.test_rows.x) if hasattr(active, "test_rows") else 0
    if not isinstance(th, torch.Tensor) or th.dtype != torch.float64 or th.dim() != 2 or th.shape[1] != 4 \
            or not bool(torch.isfinite(th).all()):
        return "sb_reveal thresholds must be a finite float64 tensor of rows (tree, node, feature, threshold)"
    if not isinstance(tl, torch.Tensor) or tl.dtype != torch.bool or tuple(tl.shape) != (len(th), tests):
        return f"sb_reveal test_left must be a bool tensor of {len(th)} x {tests}"
    return None


MESSAGE_CHECKS = {"sb_bins": check_bins, "sb_histograms": check_histograms, "sb_left": check_left,
                  "sb_reveal": check_reveal}
# a deployed active party checks them on the wire with the vertical course's own (validation.py)
components.get("vertical_message_checks").update(MESSAGE_CHECKS)
