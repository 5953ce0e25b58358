"""Data-plane HTTP pools: one shared aiohttp session per event loop for rollout traffic, and a small reserved one
for `_control=True` calls, so a saturated data pool never delays them.

Sessions belong to the loop that made them (an aiohttp session cannot outlive its loop), so they are kept per
loop and a new loop never gets a session bound to a dead one. Close them with `close_http_sessions()` (or
`ServerClient.aclose()`) before the loop ends.

`send` makes one call: its first attempt here, what follows a failure in gym_rpc.client._resend (docs/failures.md).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import weakref
from collections.abc import Mapping
from time import monotonic
from typing import TYPE_CHECKING, Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError

from gym_rpc.client._aiohttp_instrumentation import instrumentation_active, note_instrumented_session
from gym_rpc.client._aiohttp_instrumentation import trace_configs as instrumentation_trace_configs
from gym_rpc.client._outliers import OutlierDetection
from gym_rpc.client._resend import CallObserver, Reroute, resend_after_failure
from gym_rpc.client._resend_budget import CallCount, new_call_count
from gym_rpc.client._resend_policy import RetryPolicy
from gym_rpc.config import validation_error_line
from gym_rpc.errors import ConfigError
from gym_rpc.telemetry import instrumentation_failed

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions

__all__ = [
    "DEFAULT_TOTAL_TIMEOUT_SECONDS",
    "HTTP_CLIENT_KEY",
    "CallObserver",
    "HttpClientSettings",
    "HttpPools",
    "LoopSessions",
    "Reroute",
    "RetryPolicy",
    "close_http_sessions",
    "close_loop_sessions",
    "loop_sessions",
    "send",
]

HTTP_CLIENT_KEY = "http_client"
# NeMo Gym's top-level keys for its shared aiohttp pool and its sockets -> the `http_client:` setting each one is.
UPSTREAM_POOL_KEYS = {
    "global_aiohttp_connector_limit": "max_connections",
    "global_aiohttp_connector_limit_per_host": "max_connections_per_host",
    "global_aiohttp_tcp_keepalive_idle_seconds": "tcp_keepalive_idle_seconds",
    "global_aiohttp_tcp_keepalive_interval_seconds": "tcp_keepalive_interval_seconds",
    "global_aiohttp_tcp_keepalive_probes": "tcp_keepalive_probes",
}
DEFAULT_TOTAL_TIMEOUT_SECONDS = 1800.0  # per data-plane call, headers included; see HttpClientSettings
# How long an idle pooled connection is kept: NeMo Gym's 15 s, below the 30 s after which its uvicorn servers close
# an idle connection (NeMo Gym #1555): a connection the server may be closing is never reused.
DEFAULT_POOL_KEEPALIVE_SECONDS = 15.0


class HttpClientSettings(BaseModel):
    """The optional `http_client:` block of the global config; every key has a default."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    # NeMo Gym's defaults (its `global_aiohttp_connector_limit` and `..._per_host`, honoured as aliases below).
    max_connections: PositiveInt = 102400
    max_connections_per_host: NonNegativeInt = 1024  # 0: only max_connections bounds one host
    control_max_connections: PositiveInt = 16
    keepalive_timeout_seconds: PositiveFloat = DEFAULT_POOL_KEEPALIVE_SECONDS  # an idle connection's time
    # TCP keepalive on every connection (NeMo Gym's `global_aiohttp_tcp_keepalive_*`, its defaults, the kernel's
    # bounds): a peer that vanished is noticed on idle and long-waiting connections.
    tcp_keepalive_idle_seconds: int = Field(default=60, ge=1, le=32767)
    tcp_keepalive_interval_seconds: int = Field(default=10, ge=1, le=32767)
    tcp_keepalive_probes: int = Field(default=3, ge=1, le=127)
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
        from_upstream = {}
        for upstream_key, key in UPSTREAM_POOL_KEYS.items():
            if document.get(upstream_key) is None:
                continue
            if settings.get(key, document[upstream_key]) != document[upstream_key]:
                raise ConfigError(
                    f"{upstream_key} ({document[upstream_key]}) and {HTTP_CLIENT_KEY}.{key} ({settings[key]}) "
                    f"disagree: set one of them"
                )
            settings[key] = document[upstream_key]
            from_upstream[key] = upstream_key
        try:
            return cls.model_validate(settings)
        except ValidationError as exc:
            line = validation_error_line(exc, HTTP_CLIENT_KEY)
            for key, upstream_key in from_upstream.items():  # a bad value is named where the document has it
                line = line.replace(f"{HTTP_CLIENT_KEY}.{key}:", f"{upstream_key}:", 1)
            raise ConfigError(line) from None


def _keepalive_socket(
    addr_info: aiohttp.AddrInfoType, idle_seconds: int, interval_seconds: int, probes: int
) -> socket.socket:
    """A client socket with TCP keepalive, so a peer that vanished is noticed on idle pooled connections."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))  # macOS calls it KEEPALIVE
    for option, value in (
        (idle, idle_seconds),
        (getattr(socket, "TCP_KEEPINTVL", None), interval_seconds),
        (getattr(socket, "TCP_KEEPCNT", None), probes),
    ):
        if option is not None:  # elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
    return sock


def _new_session(
    settings: HttpClientSettings, limit: int, limit_per_host: int, timeout: aiohttp.ClientTimeout
) -> aiohttp.ClientSession:
    """No proxies (trust_env=False: a proxy variable must never divert calls to Gym servers), no cookie jar."""
    sockets = functools.partial(
        _keepalive_socket,
        idle_seconds=settings.tcp_keepalive_idle_seconds,
        interval_seconds=settings.tcp_keepalive_interval_seconds,
        probes=settings.tcp_keepalive_probes,
    )
    connector = aiohttp.TCPConnector(
        limit=limit,
        limit_per_host=limit_per_host,
        keepalive_timeout=settings.keepalive_timeout_seconds,
        socket_factory=sockets,
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

    __slots__ = ("calls", "control", "data", "is_closed", "loop")

    def __init__(self, settings: HttpClientSettings) -> None:
        self.loop = asyncio.get_running_loop()
        self.calls: CallCount = new_call_count()  # ServerClient.request's, for the client-wide resend budget
        connect = settings.connect_timeout_seconds
        self.data = _new_session(
            settings,
            settings.max_connections,
            settings.max_connections_per_host,
            aiohttp.ClientTimeout(total=settings.total_timeout_seconds, sock_connect=connect),
        )
        self.control = _new_session(
            settings,
            settings.control_max_connections,
            0,
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


async def send(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    retry: RetryPolicy,
    resend_after_disconnect: bool,
    kwargs: _RequestOptions,
    observer: CallObserver | None = None,
    reroute: Reroute | None = None,
    *,
    server_name: str = "",
) -> aiohttp.ClientResponse:
    """One request, resent within `retry`'s budgets when it fails (gym_rpc.client._resend); `observer` is told of
    every attempt after the first, and of the answer or the error.

    A failure is refused, dropped before the request was written, dropped after (resent only when the caller
    allows: `resend_after_disconnect`), or a timeout; anything else, an HTTP answer above all, is the caller's at
    once. Given up, a call raises ServerUnreachableError, ServerDroppedError (an aiohttp ServerDisconnectedError
    and ClientOSError too) or RequestTimeoutError, naming `server_name`, the URL, the kind, the attempts and the
    time.
    `reroute` (replicas) gives the URL of each resend, from the error that made it; by default it is `url`.

    The happy path is the request and one clock read (the start of the call's deadline); the rest runs only after
    a failure.
    """
    started = monotonic()
    try:
        response = await session.request(method, url, **kwargs)
    except BaseException as error:
        failure = error
    else:
        if observer is not None:
            try:
                observer.answered(response, 1)
            except Exception as observer_error:  # instrumentation may fail; the call may not
                instrumentation_failed(observer.kind, observer_error)
            except BaseException:  # a cancellation, say: the caller never gets the response, released here
                response.close()
                raise
        return response
    return await resend_after_failure(
        failure,
        session,
        method,
        url,
        retry,
        resend_after_disconnect,
        kwargs,
        observer,
        server_name,
        reroute,
        started,
    )
