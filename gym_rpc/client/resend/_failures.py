"""What kind of failure ended an attempt of a data-plane call, from aiohttp's public exception types alone.

Each kind has its own resend budget (`RetryPolicy`), because each says something different about the server:

* REFUSED: the connection was never made (refused, no route, a name that does not resolve): nothing was sent.
* DROPPED_BEFORE_WRITE: the connection was made, but aiohttp found it closed when it went to write the request
  (`Cannot write to closing transport`): the whole request never went out, so the server cannot have answered it.
* DROPPED_AFTER_WRITE: the connection dropped (closed or reset) once the request may have gone out: the server may
  have read it and acted on it, so only the caller (`_resend_after_disconnect`) may allow another attempt.
* TIMEOUT: no connection within the connect timeout (nothing sent), a read that went silent (sent), or the call's
  own deadline (no time left for anything).
* BACKPRESSURE: an answer of 429 or 503 (`Backpressure`, which carries it): the server did not act on the call.

Any other HTTP answer, whatever its status, is never a failure here: it is the caller's.

Why exception types and not aiohttp's TraceConfig hooks: `on_request_headers_sent` and `on_request_chunk_sent` fire
*before* the bytes they announce are written (aiohttp >= 3.11 even holds the headers back to send them with the
first body chunk), so neither says the request went out; and a session's trace configs cost every call a Trace and
several awaited signals, which the happy path must not pay. The exceptions are raised where the write itself
fails, so they are what marks "not written". When aiohttp cannot tell (a connection the server closed just before
our write was read), the drop counts as after written: the side on which a request is never sent twice unasked.
"""

from __future__ import annotations

import email.utils
import math
import time

import aiohttp

from gym_rpc.client.resend._policy import FailureKind

# aiohttp's writer, finding the connection closed before it writes (the message of aiohttp's own
# ClientConnectionResetError, a ConnectionResetError before aiohttp 3.10.6, since aiohttp 3.3). Matched by its
# text, which fails safe: a changed message makes such a drop "after written", never the other way round.
_CLOSED_BEFORE_WRITE = "Cannot write to closing transport"


class Backpressure(Exception):
    """An answer of 429 or 503, carried through the resend loop as a failed attempt: when its budget allows no
    other attempt, the caller gets `response` itself."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        super().__init__(f"HTTP {response.status}")
        self.response = response


def retry_after_seconds(response: aiohttp.ClientResponse) -> float | None:
    """What the answer's Retry-After asks for (RFC 9110 10.2.3: seconds, or an HTTP date), or None when it has
    none that reads; a date in the past is 0."""
    value = response.headers.get("Retry-After")
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    seconds = when.timestamp() - time.time()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


def failure_kind(error: BaseException) -> FailureKind | None:
    """The kind of `error`, or None for an error no resend can help (TLS, a bad URL, a cancellation...)."""
    if isinstance(error, Backpressure):
        return FailureKind.BACKPRESSURE
    if isinstance(error, aiohttp.ClientConnectorError):  # refused, unreachable, DNS: never connected
        return None if isinstance(error, aiohttp.ClientSSLError) else FailureKind.REFUSED
    if isinstance(error, TimeoutError):  # aiohttp's ServerTimeoutError is one too
        return FailureKind.TIMEOUT
    if isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | ConnectionResetError):
        if _closed_before_write(error) or _closed_before_write(error.__cause__):
            return FailureKind.DROPPED_BEFORE_WRITE
        return FailureKind.DROPPED_AFTER_WRITE
    return None


def _closed_before_write(error: BaseException | None) -> bool:
    """aiohttp's writer refused to write: no OS error number (a reset from the peer has one), aiohttp's message."""
    return (
        isinstance(error, ConnectionResetError)
        and error.errno is None
        and str(error).startswith(_CLOSED_BEFORE_WRITE)
    )


def is_deadline(error: BaseException) -> bool:
    """A timeout that is the call's own deadline (aiohttp's total), not one of its phases: no time is left."""
    return isinstance(error, TimeoutError) and not isinstance(error, aiohttp.ServerTimeoutError)


def nothing_sent(kind: FailureKind, error: BaseException) -> bool:
    """Whether the failed attempt sent nothing the server could act on (so any call may be resent)."""
    if kind is FailureKind.TIMEOUT:
        return isinstance(error, aiohttp.ConnectionTimeoutError)
    return kind is not FailureKind.DROPPED_AFTER_WRITE  # a 429 or 503 said it did not act on it
