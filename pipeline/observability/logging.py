"""Structured logs: JSON lines for machines, a compact format for people.

Records carry the ``extra`` fields the pipeline attaches (event id, consumer,
attempt, error class — never payloads) and the current trace and span ids.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

import dramatiq
from opentelemetry import trace

from pipeline.config import Settings

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def _context_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        fields.setdefault("trace_id", format(span.trace_id, "032x"))
        fields.setdefault("span_id", format(span.span_id, "016x"))
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_context_fields(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in _context_fields(record).items())
        stamp = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        line = f"{stamp} {record.levelname:<7} {record.name}: {record.getMessage()}"
        line = f"{line} {fields}" if fields else line
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class WithoutMessageBodies(logging.Filter):
    """Dramatiq logs a message by its ``str()``, which spells out its arguments — for the
    pipeline's actors, the events' payloads ("Failed to process message ..."). Such an
    argument is replaced by the actor's name and the message id before formatting.

    Dramatiq's actors also log the arguments themselves at DEBUG ("Received args=...
    kwargs=...", under a logger named after the actor's module): in records logged by
    Dramatiq's code, any list, tuple or dict argument is withheld too, so no payload
    reaches a log at any level.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or not args:
            if isinstance(args, dict) and _from_dramatiq(record):
                # One mapping argument (logging unpacks it): the template alone is logged.
                record.msg, record.args = f"{record.msg} (arguments {WITHHELD})", None
            return True
        dramatiq_record = _from_dramatiq(record)
        if dramatiq_record or any(map(_is_message, args)):
            record.args = tuple(_safe_argument(arg, dramatiq_record) for arg in args)
        return True


WITHHELD = "<withheld>"
_DRAMATIQ_DIR = os.path.dirname(dramatiq.__file__) + os.sep


def _from_dramatiq(record: logging.LogRecord) -> bool:
    return record.name.startswith("dramatiq") or record.pathname.startswith(_DRAMATIQ_DIR)


def _safe_argument(arg: object, dramatiq_record: bool) -> object:
    if _is_message(arg):
        return f"{getattr(arg, 'actor_name')} message {getattr(arg, 'message_id')}"  # noqa: B009
    if dramatiq_record and isinstance(arg, list | tuple | dict | set | frozenset):
        return WITHHELD
    return arg


def _is_message(value: object) -> bool:
    return hasattr(value, "message_id") and hasattr(value, "actor_name")


def configure_logging(settings: Settings) -> None:
    """Install the configured formatter on the root logger (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if settings.log_format == "json" else ConsoleFormatter()
    handler.setFormatter(formatter)
    handler.addFilter(WithoutMessageBodies())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(settings.log_level)
