"""Data-plane HTTP pools: one shared aiohttp session per event loop for rollout traffic, and a small reserved one
for `_control=True` calls, so a saturated data pool never delays them.

Sessions belong to the loop that made them (an aiohttp session cannot outlive its loop), so they are kept per
loop and a new loop never gets a session bound to a dead one. Close them with `close_http_sessions()` (or
`ServerClient.aclose()`) before the loop ends.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError

from gym_rpc.client._aiohttp_instrumentation import instrumentation_active, note_instrumented_session
from gym_rpc.client._aiohttp_instrumentation import trace_configs as instrumentation_trace_configs
from gym_rpc.client._outliers import OutlierDetection
from gym_rpc.config import validation_error_line
from gym_rpc.errors import ConfigError, RequestTimeoutError, ServerUnreachableError
from gym_rpc.telemetry import instrumentation_failed

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions

HTTP_CLIENT_KEY = "http_client"
# NeMo Gym's top-level keys for its shared aiohttp pool -> the `http_client:` setting each one is.
UPSTREAM_POOL_KEYS = {
    "global_aiohttp_connector_limit": "max_connections",
    "global_aiohttp_connector_limit_per_host": "max_connections_per_host",
}
DEFAULT_TOTAL_TIMEOUT_SECONDS = 1800.0  # per data-plane call, headers included; see HttpClientSettings
_TCP_KEEPALIVE_IDLE_SECONDS = 60
_TCP_KEEPALIVE_INTERVAL_SECONDS = 10
_TCP_KEEPALIVE_PROBES = 5


class RetryPolicy(BaseModel):
    """Bounded exponential backoff with jitter for resending after a dropped connection."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    attempts: PositiveInt = 3
    initial_backoff_seconds: PositiveFloat = 0.05
    max_backoff_seconds: PositiveFloat = 1.0
    multiplier: float = Field(default=2.0, ge=1.0)  # below 1 the backoff shrinks (or flips sign) per attempt

    def backoff_seconds(self, failed_attempts: int) -> float:
        """The pause after the n-th failure: exponential, capped, with half of it random (no thundering herd)."""
        ceiling = min(
            self.max_backoff_seconds, self.initial_backoff_seconds * self.multiplier ** (failed_attempts - 1)
        )
        return ceiling / 2 + random.uniform(0, ceiling / 2)


class HttpClientSettings(BaseModel):
    """The optional `http_client:` block of the global config; every key has a default."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    # NeMo Gym's defaults (its `global_aiohttp_connector_limit` and `..._per_host`, honoured as aliases below).
    max_connections: PositiveInt = 102400
    max_connections_per_host: NonNegativeInt = 1024  # 0: only max_connections bounds one host
    control_max_connections: PositiveInt = 16
    keepalive_timeout_seconds: PositiveFloat = 30.0  # how long an idle pooled connection is kept
    connect_timeout_seconds: PositiveFloat = 10.0
    # Long enough for the slowest model generation, short enough that a server that accepted and went silent
    # fails the call instead of hanging the rollout; null turns the deadline off.
    total_timeout_seconds: PositiveFloat | None = DEFAULT_TOTAL_TIMEOUT_SECONDS
    control_total_timeout_seconds: PositiveFloat = 30.0
    retry: RetryPolicy = RetryPolicy()
    # When an instance of a replicated server is taken out of rotation (gym_rpc.client._outliers).
    outlier_detection: OutlierDetection = OutlierDetection()

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> HttpClientSettings:
        """From the `http_client:` block, and NeMo Gym's top-level pool keys (which must agree with the block)."""
        block = document.get(HTTP_CLIENT_KEY) or {}
        if not isinstance(block, Mapping):
            raise ConfigError(f"{HTTP_CLIENT_KEY} must be a mapping, not {type(block).__name__}")
        settings = dict(block)
        for upstream_key, key in UPSTREAM_POOL_KEYS.items():
            if document.get(upstream_key) is None:
                continue
            if settings.get(key, document[upstream_key]) != document[upstream_key]:
                raise ConfigError(
                    f"{upstream_key} ({document[upstream_key]}) and {HTTP_CLIENT_KEY}.{key} ({settings[key]}) "
                    f"disagree: set one of them"
                )
            settings[key] = document[upstream_key]
        try:
            return cls.model_validate(settings)
        except ValidationError as exc:
            raise ConfigError(validation_error_line(exc, HTTP_CLIENT_KEY)) from None


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


class HttpPools:
    """A client's way to its sessions: the running loop's, remembered so the hot path skips the registry."""

    __slots__ = ("_last", "settings")

    def __init__(self, settings: HttpClientSettings) -> None:
        self.settings = settings
        self._last: LoopSessions | None = None  # one attribute, so threads with their own loops cannot mix it up

    def sessions(self) -> LoopSessions:
        loop = asyncio.get_running_loop()
        sessions = self._last
        if sessions is None or sessions.loop is not loop or sessions.is_closed:
            sessions = self._last = loop_sessions(self.settings)
        return sessions

    async def close(self) -> None:
        """Close the running loop's sessions for these settings (shared with other clients using them)."""
        self._last = None
        await close_loop_sessions(self.settings)


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


# Asked by `send` before each resend, with the error the last attempt failed with: the URL to resend to. A call to
# a replicated server (gym_rpc.client._routing.RoutedCall.reroute) answers with another instance, or the same one.
Reroute = Callable[[BaseException], str]


async def send(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    retry: RetryPolicy,
    resend_after_disconnect: bool,
    kwargs: _RequestOptions,
    observer: CallObserver | None = None,
    reroute: Reroute | None = None,
) -> aiohttp.ClientResponse:
    """One request with honest, bounded retries; `observer` is told of every attempt after the first, and of the
    answer or the error. `reroute`, for a replicated server, gives the URL of each resend (another instance).

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
                if reroute is not None:
                    url = reroute(error)
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
