"""Structured JSON logs with the current correlation ids and trace id.

Log calls pass only ids, codes, counts and types in `extra`; never arguments
or results. An exception's text can quote the values it was raised over, so
no log line carries it: `exception_fields` (toolmesh.core.exceptions) gives its
type and where it was raised, and the formatter renders any traceback a library
logs as frames and exception types, without the messages.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from opentelemetry import trace

from toolmesh.core.correlation import current_ids
from toolmesh.core.exceptions import traceback_without_text

# LogRecord attributes that are not extra fields.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": _message(record),
        }
        entry.update(current_ids())
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = format(span_context.trace_id, "032x")
            entry["span_id"] = format(span_context.span_id, "016x")
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = (
                    value if isinstance(value, str | int | float | bool) or value is None else str(value)
                )
        if record.exc_info and record.exc_info[1] is not None:
            entry["exception"] = type(record.exc_info[1]).__qualname__
            entry["traceback"] = traceback_without_text(record.exc_info[1])
        return json.dumps(entry, ensure_ascii=False)


def _message(record: logging.LogRecord) -> str:
    """The record's message; of a library's record with an exception, its first line only.

    asyncio, for one, writes the exception's repr on the lines after the first
    ("Task exception was never retrieved / future: <Task ... exception=...>").
    """
    message = record.getMessage()
    if record.exc_info and not record.name.startswith("toolmesh"):
        return message.split("\n", 1)[0]
    return message


def configure_logging(service: str, level: str | None = None) -> None:
    """JSON lines on stderr; the level comes from TOOLMESH_LOG_LEVEL (default INFO)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    chosen = logging.getLevelNamesMapping().get(
        (level or os.environ.get("TOOLMESH_LOG_LEVEL", "INFO")).upper(), logging.INFO
    )
    # Our own loggers at the chosen level; libraries no chattier than INFO.
    root.setLevel(max(chosen, logging.INFO))
    logging.getLogger("toolmesh").setLevel(chosen)
