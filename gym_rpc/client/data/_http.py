"""Data-plane HTTP sessions: one shared aiohttp session per event loop for rollout traffic, and a small reserved
one for `_control=True` calls, so a saturated data pool never delays them; `send`; `json=` bodies.

Sessions belong to the loop that made them (an aiohttp session cannot outlive its loop), so they are kept per
loop and a new loop never gets a session bound to a dead one. Close them with `close_http_sessions()` (or
`ServerClient.aclose()`) before the loop ends. aiohttp comes with this module (and the tracing and metrics ones
that build on it), which ServerClient imports on its first data-plane call, not at import (its `_data_plane`).

`send` makes one call: its first attempt here, what follows a failure in gym_rpc.client.resend._resend
(docs/failures.md).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import weakref
from dataclasses import KW_ONLY, dataclass, field
from time import monotonic
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp.payload import BytesPayload

from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.client.resend import (
    BACKPRESSURE_STATUSES,
    Backpressure,
    CallCount,
    CallObserver,
    Reroute,
    RetryPolicy,
    new_call_count,
    register_fresh_twin,
    resend_after_failure,
)
from gym_rpc.client.tracing import instrumentation_active, note_instrumented_session
from gym_rpc.client.tracing import trace_configs as instrumentation_trace_configs
from gym_rpc.telemetry import instrumentation_failed

if TYPE_CHECKING:
    pass

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions

__all__ = [
    "Call",
    "CallObserver",
    "LoopSessions",
    "Reroute",
    "close_http_sessions",
    "close_loop_sessions",
    "json_payload",
    "loop_sessions",
    "send",
]

_JSON_CONTENT_TYPE = "application/json"


def json_payload(body: Any) -> BytesPayload:
    """A `json=` body serialised as NeMo Gym does (orjson: datetimes as RFC 3339, NaN as null), several times
    faster than aiohttp's default `json.dumps`; a Content-Type the caller set still wins, as with aiohttp."""
    return BytesPayload(orjson.dumps(body), content_type=_JSON_CONTENT_TYPE)


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
    settings: HttpClientSettings,
    limit: int,
    limit_per_host: int,
    timeout: aiohttp.ClientTimeout,
    *,
    fresh: bool = False,
) -> aiohttp.ClientSession:
    """No proxies (trust_env=False: a proxy variable must never divert calls to Gym servers), no cookie jar.
    `fresh`: every request on a new connection, closed after its answer (resends after a drop)."""
    sockets = functools.partial(
        _keepalive_socket,
        idle_seconds=settings.tcp_keepalive_idle_seconds,
        interval_seconds=settings.tcp_keepalive_interval_seconds,
        probes=settings.tcp_keepalive_probes,
    )
    if fresh:
        connector = aiohttp.TCPConnector(
            limit=limit, limit_per_host=limit_per_host, force_close=True, socket_factory=sockets
        )
    else:
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

    __slots__ = ("calls", "control", "data", "is_closed", "loop", "twins")

    def __init__(self, settings: HttpClientSettings) -> None:
        self.loop = asyncio.get_running_loop()
        self.calls: CallCount = new_call_count()  # ServerClient.request's, for the client-wide resend budget
        connect = settings.connect_timeout_seconds
        data = (
            settings,
            settings.max_connections,
            settings.max_connections_per_host,
            aiohttp.ClientTimeout(total=settings.total_timeout_seconds, sock_connect=connect),
        )
        control = (
            settings,
            settings.control_max_connections,
            0,
            aiohttp.ClientTimeout(total=settings.control_total_timeout_seconds, sock_connect=connect),
        )
        self.data = _new_session(*data)
        self.control = _new_session(*control)
        # Each one's twin for resends after a drop (gym_rpc.client.resend._fresh), made at the first such resend.
        self.twins = (FreshTwin(*data), FreshTwin(*control))
        register_fresh_twin(self.data, self.twins[0].session)
        register_fresh_twin(self.control, self.twins[1].session)
        self.is_closed = False

    async def close(self) -> None:
        self.is_closed = True
        await self.data.close()
        await self.control.close()
        for twin in self.twins:
            await twin.close()


class FreshTwin:
    """A pooled session's twin that opens a new connection for every request, made on first use with the pooled
    one's settings, limits and timeout (and instrumentation). It holds no reference to the pooled session."""

    __slots__ = ("_made", "limit", "limit_per_host", "settings", "timeout")

    def __init__(
        self, settings: HttpClientSettings, limit: int, limit_per_host: int, timeout: aiohttp.ClientTimeout
    ) -> None:
        self.settings, self.limit, self.limit_per_host, self.timeout = settings, limit, limit_per_host, timeout
        self._made: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._made is None or self._made.closed:
            self._made = _new_session(self.settings, self.limit, self.limit_per_host, self.timeout, fresh=True)
        return self._made

    async def close(self) -> None:
        if self._made is not None:
            await self._made.close()


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


@dataclass(slots=True, eq=False)
class Call:
    """One call: where it goes (`session`, `method`, `url`, aiohttp's `kwargs`), to which server and rollout (its
    key, once worked out, or None), its budgets (`retry`) and whether a request that may have been written may
    go out again (`resend`), who is told how it goes (`observer`) and, for a replicated server, where each resend
    goes (`reroute`). `started` is the start of its deadline (time.monotonic), set when its first attempt goes
    out."""

    session: aiohttp.ClientSession
    method: str
    url: str
    kwargs: _RequestOptions
    retry: RetryPolicy
    _: KW_ONLY
    server: str = ""
    resend: bool = True
    rollout: str | None = None
    observer: CallObserver | None = None
    reroute: Reroute | None = None
    started: float = field(default=0.0, init=False)

    def __repr__(self) -> str:
        return f"<Call {self.method} {self.url} to {self.server or '?'}>"


async def send(call: Call) -> aiohttp.ClientResponse:
    """Make `call`: one request, resent within `call.retry`'s budgets when it fails (gym_rpc.client.resend); its
    observer is told of every attempt after the first, and of the answer or the error.

    A failure is refused, dropped before the request was written, dropped after (resent only when the call allows:
    `call.resend`), a timeout, or an answer of 429 or 503 (resent within its own budget, else the caller's);
    anything else, any other HTTP answer above all, is the caller's at once. Given up, a call raises
    ServerUnreachableError, ServerDroppedError (an aiohttp ServerDisconnectedError and ClientOSError too) or
    RequestTimeoutError, naming the server, the URL, the kind, the attempts and the time. `call.reroute`
    (replicas) gives the URL of each resend, from the error that made it; by default it is `call.url`.

    The happy path is the request and one clock read (the start of the call's deadline); the rest runs only after
    a failure.
    """
    call.started = monotonic()
    try:
        response = await call.session.request(call.method, call.url, **call.kwargs)
    except BaseException as error:
        failure = error
    else:
        status = response.status
        if status >= 429 and status in BACKPRESSURE_STATUSES:  # busy: elsewhere, or after its Retry-After
            return await resend_after_failure(call, Backpressure(response))
        observer = call.observer
        if observer is not None:
            try:
                observer.answered(response, 1)
            except Exception as observer_error:  # instrumentation may fail; the call may not
                instrumentation_failed(observer.kind, observer_error)
            except BaseException:  # a cancellation, say: the caller never gets the response, released here
                response.close()
                raise
        return response
    return await resend_after_failure(call, failure)
