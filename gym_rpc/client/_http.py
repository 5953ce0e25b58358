"""Data-plane HTTP sessions: one shared aiohttp session per event loop for rollout traffic, and a small reserved
one for `_control=True` calls, so a saturated data pool never delays them; the bounded resends; `json=` bodies.

Sessions belong to the loop that made them (an aiohttp session cannot outlive its loop), so they are kept per
loop and a new loop never gets a session bound to a dead one. Close them with `close_http_sessions()` (or
`ServerClient.aclose()`) before the loop ends. aiohttp comes with this module (and the tracing and metrics ones
that build on it), which ServerClient imports on its first data-plane call, not at import (its `_data_plane`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson
from aiohttp.payload import BytesPayload

from gym_rpc.client._aiohttp_instrumentation import instrumentation_active, note_instrumented_session
from gym_rpc.client._aiohttp_instrumentation import trace_configs as instrumentation_trace_configs
from gym_rpc.client._http_settings import HttpClientSettings, RetryPolicy
from gym_rpc.errors import RequestTimeoutError, ServerUnreachableError
from gym_rpc.telemetry import instrumentation_failed

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions

_TCP_KEEPALIVE_IDLE_SECONDS = 60
_TCP_KEEPALIVE_INTERVAL_SECONDS = 10
_TCP_KEEPALIVE_PROBES = 5
_JSON_CONTENT_TYPE = "application/json"


def json_payload(body: Any) -> BytesPayload:
    """A `json=` body serialised as NeMo Gym does (orjson: datetimes as RFC 3339, NaN as null), several times
    faster than aiohttp's default `json.dumps`; a Content-Type the caller set still wins, as with aiohttp."""
    return BytesPayload(orjson.dumps(body), content_type=_JSON_CONTENT_TYPE)


def _keepalive_socket(addr_info: aiohttp.AddrInfoType) -> socket.socket:
    """A client socket with TCP keepalive, so a peer that vanished is noticed on idle pooled connections."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system defaults apply
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _TCP_KEEPALIVE_IDLE_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _TCP_KEEPALIVE_INTERVAL_SECONDS)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _TCP_KEEPALIVE_PROBES)
    return sock


def _new_session(
    limit: int, limit_per_host: int, keepalive: float, timeout: aiohttp.ClientTimeout
) -> aiohttp.ClientSession:
    """No proxies (trust_env=False: a proxy variable must never divert calls to Gym servers), no cookie jar."""
    connector = aiohttp.TCPConnector(
        limit=limit, limit_per_host=limit_per_host, keepalive_timeout=keepalive, socket_factory=_keepalive_socket
    )
    instrumented = instrumentation_active()  # decided once per session: the instrumentation adds its own config
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        trace_configs=instrumentation_trace_configs() if instrumented else None,
    )
    if instrumented:
        note_instrumented_session(session)
    return session


class LoopSessions:
    """The data and reserved control sessions of one event loop (for one HttpClientSettings)."""

    __slots__ = ("control", "data", "is_closed", "loop")

    def __init__(self, settings: HttpClientSettings) -> None:
        self.loop = asyncio.get_running_loop()
        connect = settings.connect_timeout_seconds
        self.data = _new_session(
            settings.max_connections,
            settings.max_connections_per_host,
            settings.keepalive_timeout_seconds,
            aiohttp.ClientTimeout(total=settings.total_timeout_seconds, sock_connect=connect),
        )
        self.control = _new_session(
            settings.control_max_connections,
            0,
            settings.keepalive_timeout_seconds,
            aiohttp.ClientTimeout(total=settings.control_total_timeout_seconds, sock_connect=connect),
        )
        self.is_closed = False

    async def close(self) -> None:
        self.is_closed = True
        await self.data.close()
        await self.control.close()


_sessions_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[HttpClientSettings, LoopSessions]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def loop_sessions(settings: HttpClientSettings) -> LoopSessions:
    """The running loop's sessions for `settings`, made on first use (the cold path)."""
    loop = asyncio.get_running_loop()
    with _lock:
        _forget_closed_loops()
        per_loop = _sessions_by_loop.setdefault(loop, {})
        sessions = per_loop.get(settings)
        if sessions is None or sessions.is_closed:
            sessions = per_loop[settings] = LoopSessions(settings)
        return sessions


def _forget_closed_loops() -> None:
    """Drop the sessions of loops that ended: they can never be used again (and their sessions refer to the loop,
    so the weak key alone would never let it go)."""
    for loop in [loop for loop in _sessions_by_loop if loop.is_closed()]:
        del _sessions_by_loop[loop]


async def close_loop_sessions(settings: HttpClientSettings) -> None:
    """Close the running loop's sessions for `settings` and forget them."""
    loop = asyncio.get_running_loop()
    with _lock:
        per_loop = _sessions_by_loop.get(loop, {})
        sessions = per_loop.pop(settings, None)
        if not per_loop:
            _sessions_by_loop.pop(loop, None)
    if sessions is not None:
        await sessions.close()


async def close_http_sessions() -> None:
    """Close every session of the running loop (call before the loop ends)."""
    with _lock:
        per_loop = _sessions_by_loop.pop(asyncio.get_running_loop(), {})
    for sessions in per_loop.values():
        await sessions.close()


# What may be worth another attempt: a dropped connection (ServerDisconnectedError, ClientOSError) and a refused
# or unreachable server (ClientConnectorError, a ClientOSError too). `send` decides; nothing else is retried.
RESENDABLE_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class CallObserver(Protocol):
    """What `send` tells whoever observes a call (a span, the worker metrics): each attempt after the first, then
    the answer or the error the caller gets, with the number of attempts made. Told from inside `send`, so
    observing adds no coroutine between the caller and aiohttp (each one costs every resumption of the call).

    An observer may fail, a call may not: whatever an observer raises is logged under its `kind` ("tracing",
    "metrics"; gym_rpc.telemetry.instrumentation_failed) and the call goes on, its answer returned (or its own
    error raised) and its connection released."""

    kind: str

    def resent(self, attempt: int) -> None: ...

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None: ...

    def failed(self, error: BaseException, attempts: int) -> None: ...


async def send(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    retry: RetryPolicy,
    resend_after_disconnect: bool,
    kwargs: _RequestOptions,
    observer: CallObserver | None = None,
) -> aiohttp.ClientResponse:
    """One request with honest, bounded retries; `observer` is told of every attempt after the first, and of the
    answer or the error.

    A dropped connection (ServerDisconnectedError, ClientOSError) is resent only when the caller allows it. A
    refused or unreachable server (ClientConnectorError) never received the request, so it is retried as well and
    then reported as ServerUnreachableError naming the URL. Nothing else is retried.
    """
    attempt = 1
    try:
        while True:
            try:
                response = await session.request(method, url, **kwargs)
                break
            except RESENDABLE_ERRORS as error:
                _raise_unless_resendable(error, url, attempt, retry, resend_after_disconnect)
            await asyncio.sleep(retry.backoff_seconds(attempt))
            attempt += 1
            if observer is not None:
                try:
                    observer.resent(attempt)
                except Exception as observer_error:
                    instrumentation_failed(observer.kind, observer_error)
    except BaseException as error:
        if observer is not None:
            try:
                observer.failed(error, attempt)
            except Exception as observer_error:
                instrumentation_failed(observer.kind, observer_error)
        raise  # the call's own error
    if observer is not None:
        try:
            observer.answered(response, attempt)
        except Exception as observer_error:
            instrumentation_failed(observer.kind, observer_error)
        except BaseException:  # a cancellation, say: the caller never gets the response, so it is released here
            response.close()
            raise
    return response


def _raise_unless_resendable(
    error: aiohttp.ClientError, url: str, attempt: int, retry: RetryPolicy, resend_after_disconnect: bool
) -> None:
    """Raise what the caller sees when attempt number `attempt` failed with `error` and no other may follow."""
    if isinstance(error, aiohttp.ClientSSLError):  # a ClientConnectorError too, but retrying cannot fix TLS
        raise error
    if isinstance(error, aiohttp.ClientConnectorError):
        if attempt >= retry.attempts:
            raise ServerUnreachableError(url, attempt, str(error.os_error or error)) from error
        return
    if not resend_after_disconnect or attempt >= retry.attempts:
        raise error


def request_timeout_error(
    server_name: str, method: str, url: str, session: aiohttp.ClientSession, kwargs: Mapping[str, Any]
) -> RequestTimeoutError:
    """The error for a data-plane call that ran out of time: which server, which URL, which deadline."""
    timeout = kwargs.get("timeout")
    if not isinstance(timeout, aiohttp.ClientTimeout):
        timeout = session.timeout
    return RequestTimeoutError(server_name, method, url, timeout.total, timeout.sock_connect)
