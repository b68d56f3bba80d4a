"""What the dashboard reads from a run's folder: its records from a byte offset on.

A page polls again and again while the course runs; each poll reads only the bytes
`metrics.jsonl` (and a study's `trials.jsonl`) gained since the offset the page holds, and
only whole lines (a line being written is left for the next poll). What goes out is the
records' numbers and the project's own words, nothing of the config (which holds paths,
tokens and the course's values): a record's non-numeric fields are dropped, and the
summary's fields are the few the page draws.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["read_lines", "run_update", "MAX_READ"]

MAX_READ = 4 * 2 ** 20   # bytes read per file and poll: a long run's history comes in several
SUMMARY_FIELDS = ("rounds", "virtual_time", "wall_time", "bytes_up", "bytes_down", "final_test_acc",
                  "best_test_acc", "best_round", "dp_epsilon", "stopped_by")
TRIAL_FIELDS = ("trial", "budget", "status", "objective", "rounds", "wall_time")


def _numbers(obj: dict) -> dict[str, Any]:
    """The numeric (finite) fields of a record."""
    out = {}
    for k, v in obj.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = v
    return out


def read_lines(path: Path, offset: int, limit: int = MAX_READ) -> tuple[list[dict], int]:
    """The JSON objects of the whole lines of `path` after byte `offset` (at most `limit` bytes
    read), and the offset after the last whole line. A file shorter than `offset` (a run
    started again in the folder) is read from its start; a line that is not a JSON object is
    skipped."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if offset > size:
                offset = 0
            f.seek(offset)
            chunk = f.read(limit)
    except OSError:
        return [], 0
    end = chunk.rfind(b"\n") + 1
    out = []
    for line in chunk[:end].splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out, offset + end


def _summary(folder: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict):
        return None
    out = {k: summary[k] for k in SUMMARY_FIELDS if isinstance(summary.get(k), (int, float, str))}
    refused = dict(summary.get("admission") or {})
    refused.update((summary.get("deployment") or {}).get("refused") or {})
    out["refused"] = {str(k): v for k, v in refused.items() if isinstance(v, int)}
    out["dropped"] = len(summary.get("dropped") or [])
    out["lost_clients"] = len(summary.get("lost_clients") or [])
    return out


def run_update(folder: Path, offset: int = 0, trials_offset: int = 0) -> dict[str, Any]:
    """One poll's answer for the run (or study) in `folder`."""
    lines, offset = read_lines(folder / "metrics.jsonl", offset)
    records = [_numbers(r) for r in lines if isinstance(r.get("round"), int)]
    rows, trials_offset = read_lines(folder / "trials.jsonl", trials_offset)
    trials = [{k: r.get(k) for k in TRIAL_FIELDS if isinstance(r.get(k), (int, float, str))}
              for r in rows]
    return {"records": records, "offset": offset, "trials": trials, "trials_offset": trials_offset,
            "summary": _summary(folder)}
