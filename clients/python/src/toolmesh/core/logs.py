"""Structured JSON logs with the current correlation ids and trace id.

Log calls pass only ids, codes, counts and types in `extra`; never arguments
or results.
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
            "msg": record.getMessage(),
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
        if record.exc_info and record.exc_info[0] is not None:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


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
