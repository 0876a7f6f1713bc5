"""Logging the same way in every process: one JSON object a line when stderr is not a
terminal (or ``CAIRN_LOG_FORMAT=json``), readable text on a terminal (or ``=text``).

The ids a line is about (task, attempt, worker, run, schedule) come from ``extra=`` or
from ``log_context``, which sets them for everything logged inside it, also in the tasks
it starts.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, TextIO

IDS = ("task_id", "attempt_id", "worker_id", "run_id", "schedule_id")

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "cairn_log_context", default=None
)


@contextlib.contextmanager
def log_context(**ids: Any) -> Iterator[None]:
    """Every line logged inside carries ``ids`` (``task_id=..., attempt_id=...``)."""
    unknown = set(ids) - set(IDS)
    if unknown:
        raise ValueError(f"not a log id: {sorted(unknown)}")
    token = _context.set({**(_context.get() or {}), **ids})
    try:
        yield
    finally:
        _context.reset(token)


def bind(**ids: Any) -> None:
    """Add ``ids`` to the current context for good: for a task's own lifetime (an
    attempt's asyncio task) or a process's (its worker id)."""
    unknown = set(ids) - set(IDS)
    if unknown:
        raise ValueError(f"not a log id: {sorted(unknown)}")
    _context.set({**(_context.get() or {}), **ids})


class ContextFilter(logging.Filter):
    """Copies the ids of ``log_context`` onto each record (``extra=`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_context.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the ids, the service."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in IDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {service} %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = " ".join(f"{k}={getattr(record, k)}" for k in IDS if getattr(record, k, None))
        return f"{text} [{ids}]" if ids else text


def wants_json(stream: TextIO, choice: str | None = None) -> bool:
    choice = (choice or os.environ.get("CAIRN_LOG_FORMAT") or "auto").lower()
    if choice in ("json", "text"):
        return choice == "json"
    return not (hasattr(stream, "isatty") and stream.isatty())


def setup(service: str, level: str = "info", stream: TextIO | None = None) -> logging.Handler:
    """Replace the root logger's handlers with one that writes to ``stream`` (stderr)."""
    out = stream or sys.stderr
    handler = logging.StreamHandler(out)
    formatter = JsonFormatter(service) if wants_json(out) else TextFormatter(service)
    handler.setFormatter(formatter)
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # One line per HTTP request the clients make (a worker claims every second) is noise
    # at info; their warnings still show.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
    return handler
