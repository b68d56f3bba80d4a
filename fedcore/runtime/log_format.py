"""`log_format: json`: one JSON object per log line, for log shippers (Loki, Fluent Bit, ...).

Each object holds what the text line does (level, logger, message) plus the time (UTC,
ISO 8601) and, where the process knows them, its worker and the round it is in (a
deployed server or edge sets `context` once its course is built). An exception's
traceback goes in `exc_info` as text, inside the same line.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any, Callable

__all__ = ["JsonFormatter", "apply_log_format", "set_context", "TEXT_FORMAT"]

TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"

_context: Callable[[], dict[str, Any]] | None = None


def set_context(provider: Callable[[], dict[str, Any]] | None) -> None:
    """Where this process's worker and round come from (None: unknown)."""
    global _context
    _context = provider


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if _context is not None:
            try:
                out.update(_context())
            except Exception:   # a context half-built (or torn down) leaves the line without it
                pass
        for name in ("worker", "round"):   # a call's own extra={...} wins
            if hasattr(record, name):
                out[name] = getattr(record, name)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def apply_log_format(kind: str) -> None:
    """Format the root logger's handlers' lines as `kind` (text or json)."""
    formatter = JsonFormatter() if kind == "json" else logging.Formatter(TEXT_FORMAT)
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(formatter)
