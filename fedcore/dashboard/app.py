"""The dashboard's answers: one page, its bundled scripts, and the JSON it polls.

The same object answers for `python -m fedcore.dashboard` (runs' folders, read as they
grow) and for a deployed server's operations port (its own outdir, plus the live facts
its metrics collector reads). Paths a request names are looked up in fixed tables, never
joined to a folder, so no request reads a file the dashboard does not list.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fedcore.dashboard.feed import run_update

__all__ = ["Dashboard", "STATIC"]

# request path -> (packaged file, content type)
STATIC = {
    "": ("index.html", "text/html; charset=utf-8"),
    "index.html": ("index.html", "text/html; charset=utf-8"),
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "uPlot.iife.min.js": ("uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("uPlot.min.css", "text/css; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
JSON = "application/json"
Answer = tuple[int, str, bytes]


def _json(status: int, obj: Any) -> Answer:
    return status, JSON, json.dumps(obj, allow_nan=False).encode()


def _int(query: dict, name: str) -> int | None:
    try:
        value = int(query.get(name, ["0"])[0])
    except ValueError:
        return None
    return value if value >= 0 else None


def live_facts(registry) -> dict[str, Any]:
    """A course's live state from its metrics registry: {metric: [[labels, value], ...]}."""
    out: dict[str, list] = {}
    for family in registry.collect():
        if family.type == "histogram":
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out.setdefault(s.name, []).append([dict(s.labels), s.value])
    return out


class Dashboard:
    """Answers `respond(path, query)` for runs' folders `runs` (and a live course's registry)."""

    def __init__(self, runs: list[Path], live=None):
        self.runs = [Path(r) for r in runs]
        self.live = live

    def respond(self, path: str, query: str) -> Answer:
        path = path.lstrip("/")
        if path in STATIC:
            name, ctype = STATIC[path]
            return 200, ctype, resources.files("fedcore.dashboard").joinpath("static", name).read_bytes()
        q = parse_qs(query)
        if path == "api/runs":
            # each run's folder name only: where it lies on this machine is not the page's business
            return _json(200, {"runs": [{"id": i, "name": r.name or str(i)} for i, r in enumerate(self.runs)],
                               "live": self.live is not None})
        if path == "api/run":
            i, offset, toffset = _int(q, "id"), _int(q, "offset"), _int(q, "trials_offset")
            if i is None or i >= len(self.runs) or offset is None or toffset is None:
                return _json(400, {"error": "id, offset and trials_offset are whole numbers; id names a listed run"})
            return _json(200, run_update(self.runs[i], offset, toffset))
        if path == "api/live" and self.live is not None:
            return _json(200, live_facts(self.live))
        return _json(404, {"error": "not found"})
