"""Malformed requests on the head's HTTP-side ports (NeMo Gym's HTTP head, the metrics port) are the client's
mistake: counted, and logged at most once per window per client, one line without a traceback.

aiohttp logs each request it cannot parse (a bad `Content-Length`, a broken chunk) as an ERROR with an 11-line
traceback, so any client could fill the head's log (1.67 MB for 3,000 requests). Its request handler takes the
logger to use (aiohttp's documented `logger` argument of the server); the head gives it a `QuietRequestLog`, which
turns those lines into `gym.head.bad_requests` and a WARNING per client per BAD_REQUEST_WINDOW_SECONDS (and at most
MAX_LINES_PER_WINDOW for all clients), and passes every other line on as it is (a handler's own failure keeps its
traceback: that is the head's bug, not the client's).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gym_rpc.errors import quoted
from gym_rpc.server.observability import head_metrics as head_metrics

logger = logging.getLogger("gym_rpc.server._quiet_http_log")  # its name from before the move

BAD_REQUEST_WINDOW_SECONDS = 10.0
MAX_LINES_PER_WINDOW = 20  # all clients together: many addresses cannot flood the log either
MAX_CLIENTS_TRACKED = 4096
_PARSE_FAILURE = "Error handling request"  # how aiohttp's request handler starts a request it could not parse


class QuietRequestLog(logging.Logger):
    """The logger given to aiohttp's request handler of one port (`port`: what the metric and the line call it);
    its records go to this module's logger."""

    def __init__(self, port: str) -> None:
        super().__init__(f"{logger.name}.{port}")
        self.parent = logger  # records are handled by this module's logger and its ancestors
        self.port = port
        self._logged: dict[str, float] = {}  # client -> when its last line was logged (time.monotonic())
        self._window = (0.0, 0)  # (start, lines logged in it) for all clients

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if not self._bad_request(msg, args, exc_info):
            super().exception(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        if not self._bad_request(msg, args, kwargs.get("exc_info")):  # non-HTTP bytes (aiohttp says so at debug)
            super().debug(msg, *args, **kwargs)

    def _bad_request(self, msg: object, args: tuple[object, ...], exc_info: Any) -> bool:
        """Count and maybe log a request that did not parse; False for any other line."""
        if not (isinstance(msg, str) and msg.startswith(_PARSE_FAILURE)):
            return False
        head_metrics.bad_request(self.port)
        client = str(args[0]) if args else "an unknown client"
        now = time.monotonic()
        if now - self._logged.get(client, -BAD_REQUEST_WINDOW_SECONDS) < BAD_REQUEST_WINDOW_SECONDS:
            return True
        start, lines = self._window
        if now - start >= BAD_REQUEST_WINDOW_SECONDS:
            start, lines = now, 0
        if lines >= MAX_LINES_PER_WINDOW:
            return True
        self._window = (start, lines + 1)
        if len(self._logged) >= MAX_CLIENTS_TRACKED:
            self._logged.clear()
        self._logged[client] = now
        logger.warning(
            "%s port: a malformed request from %s answered 400 (%s); at most one line per client per %g s "
            "(all counted in gym_head_bad_requests_total)",
            self.port,
            client,
            _what(exc_info),
            BAD_REQUEST_WINDOW_SECONDS,
        )
        return True


def _what(exc_info: Any) -> str:
    """The parse error in one short line."""
    if isinstance(exc_info, BaseException):
        return f"{type(exc_info).__name__}: {quoted(' '.join(str(exc_info).split()))}"
    return "not HTTP"


UVICORN_LOGGER = "uvicorn.error"  # where uvicorn (the Connect port) says "Invalid HTTP request received."
_UVICORN_INVALID = "Invalid HTTP request received."
# A body that breaks off mid-chunk: uvicorn answers 400 itself, then the application's own error answer meets a
# connection h11 already closed, and uvicorn logs that with a traceback. The client's mistake, not the head's.
_UVICORN_APP_FAILURE = "Exception in ASGI application"
_CLOSED_BY_PROTOCOL = "LocalProtocolError"


def _answer_after_bad_body(record: logging.LogRecord) -> bool:
    """Whether uvicorn's record is the traceback of an answer to a request whose body broke off (the request was
    counted already, by uvicorn's "Invalid HTTP request received.")."""
    error = record.exc_info[1] if record.exc_info else None
    return record.getMessage().strip() == _UVICORN_APP_FAILURE and type(error).__name__ == _CLOSED_BY_PROTOCOL


class QuietInvalidRequests(logging.Filter):
    """A filter on uvicorn's logger while the Connect port serves: each "Invalid HTTP request received." (uvicorn
    names no client) is counted in gym.head.bad_requests{gym.port=connect} and one line per
    BAD_REQUEST_WINDOW_SECONDS passes, saying how many were not logged; the traceback uvicorn logs when the
    application then answers a request whose body broke off is dropped. Every other line passes as it is."""

    def __init__(self, port: str = "connect") -> None:
        super().__init__()
        self.port = port
        self._last = -BAD_REQUEST_WINDOW_SECONDS
        self._unlogged = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if _answer_after_bad_body(record):
            return False
        if record.getMessage() != _UVICORN_INVALID:
            return True
        head_metrics.bad_request(self.port)
        now = time.monotonic()
        if now - self._last < BAD_REQUEST_WINDOW_SECONDS:
            self._unlogged += 1
            return False
        more = f" ({self._unlogged} more in the last {BAD_REQUEST_WINDOW_SECONDS:g} s)" if self._unlogged else ""
        record.msg, record.args, record.exc_info = f"{self.port} port: {_UVICORN_INVALID}{more}", None, None
        self._last, self._unlogged = now, 0
        return True
