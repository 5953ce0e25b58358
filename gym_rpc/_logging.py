"""Log set-up for `gym-rpc` processes: timestamps, levels and logger names, as text or one JSON object per line.

The library only logs (`logging.getLogger(__name__)`); the command decides where and how. JSON lines carry the
current span's trace and span ids when a span is current, so a log line can be found from its trace and back.
Fields given with `extra={...}` (the head's status changes carry `gym.server.name`, `from`, `to`) are kept.
`RateLimitedLog` turns a failure that repeats (an accept that fails, a span processor that raises on every call)
into one line per interval with a count.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"
# Attributes every LogRecord has: anything else on a record came from `extra=` and goes into the JSON object.
_STANDARD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def _utc_timestamp(created: float) -> str:
    """RFC 3339 in UTC with milliseconds: 2026-11-30T22:41:07.123Z."""
    return f"{time.strftime(_TIME_FORMAT, time.gmtime(created))}.{int(created % 1 * 1000):03d}Z"


class UtcTextFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER: message`, time in UTC: lines from several hosts sort together."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc_timestamp(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, trace/span ids, exception, `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _utc_timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        from opentelemetry import trace  # loaded by the first JSON line, not by the import

        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = format(context.trace_id, "032x")
            entry["span_id"] = format(context.span_id, "016x")
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRIBUTES and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str, stream: IO[str] | None = None) -> None:
    """Send every gym_rpc (and library) log record at `level` or above to stderr in `log_format`."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else UtcTextFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())


class RateLimitedLog:
    """Log a repeating problem at most once per `interval_seconds` (at `level`), saying how many were not
    logged."""

    def __init__(
        self, log: logging.Logger, interval_seconds: float = 10.0, *, level: int = logging.WARNING
    ) -> None:
        self._log = log
        self._interval = interval_seconds
        self._level = level
        self._last = -float("inf")
        self._suppressed = 0

    def warning(self, message: str, *, exc_info: BaseException | None = None) -> None:
        """`log`, by the name of the level most problems are logged at."""
        self.log(message, exc_info=exc_info)

    def log(self, message: str, *, exc_info: BaseException | None = None) -> None:
        """`message` (with `exc_info`'s traceback, when given) unless one was logged within the interval."""
        now = time.monotonic()
        if now - self._last < self._interval:
            self._suppressed += 1
            return
        suffix = f" ({self._suppressed} more like it in the last {self._interval:g} s)" if self._suppressed else ""
        self._last, self._suppressed = now, 0
        self._log.log(self._level, "%s%s", message, suffix, exc_info=exc_info)
