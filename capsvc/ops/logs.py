"""Structured logs: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import os
import sys
from datetime import UTC, datetime

import msgspec

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as JSON: time, level, logger, message, the process's pid and, in a
    worker of `capsvc serve --workers N`, its index (0 to N-1, the same for the worker that
    replaces it), then any `extra` fields."""

    def __init__(self) -> None:
        super().__init__()
        index = os.environ.get("CAPSVC_WORKER")
        self.worker = int(index) if index is not None and index.isdigit() else None

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if self.worker is not None:
            out["worker"] = self.worker
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(out, enc_hook=str).decode()


def setup(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
