"""Bounds on the head's HTTP side (NeMo Gym's HTTP head, the metrics port, the Connect port), so idle or slow
clients there can never starve its gRPC port.

Without them ~1,000 idle sockets on one of those ports take every file descriptor of a process limited to 1,024:
the gRPC port can no longer accept, and asyncio logs a traceback per failed accept (100 MB in 20 s). Here:

* `BoundedListener` accepts at most `max_connections` at once and stops accepting at the bound (further clients
  wait in the kernel's backlog, costing the head no descriptor); a connection that sends no complete request
  (nor completes its TLS handshake) within `header_timeout_seconds` is dropped, and idle keep-alive connections
  close after the HTTP server's own keep-alive timeout. `BoundedSite` serves an aiohttp app through one.
* `connection_bound` keeps a reserve of descriptors for gRPC, the prober and files whatever the limit, and
  `grpc_connection_bound` sizes the gRPC port's own bound (grpc closes connections past it at once) inside that
  reserve: with every port full, OTHER_FD_RESERVE descriptors stay free for the prober, reloads and the rest.
* `raise_fd_soft_limit` lifts the soft limit to the hard one where the system allows.
* a repeating accept failure is logged once per interval with a count (`gym_rpc._logging.RateLimitedLog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import resource
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.log import server_logger

from gym_rpc._logging import RateLimitedLog
from gym_rpc.errors import GymRpcError

logger = logging.getLogger("gym_rpc.server._connection_limits")  # its name from before the move

DEFAULT_MAX_HTTP_CONNECTIONS = 256
DEFAULT_MAX_CONNECT_CONNECTIONS = 1024  # the Connect port: each open watch holds one
DEFAULT_MAX_GRPC_CONNECTIONS = 16384  # the gRPC port (HeadOptions.max_connections): a fleet's 10,000 followers
MIN_GRPC_CONNECTIONS = 16
HEALTH_PORT_CONNECTIONS = 64  # the plaintext health port (head_server.health_port): probes, not clients
# Never given to any port's connections: the prober's probes (at most 100 at once), the health port's
# connections, config reloads, log files, the event loop's own descriptors.
OTHER_FD_RESERVE = 256
DEFAULT_HEADER_TIMEOUT_SECONDS = 10.0  # a client has this long to send its first request's headers
DEFAULT_KEEPALIVE_TIMEOUT_SECONDS = 15.0  # an idle keep-alive connection is closed after this
FD_RESERVE = 512  # descriptors never given to HTTP connections: the gRPC port's share and OTHER_FD_RESERVE
MIN_HTTP_CONNECTIONS = 8
HTTP_PORTS = 3  # bounded ports one head may serve: NeMo Gym's HTTP head, the metrics port, the Connect port
ACCEPT_RETRY_SECONDS = 0.5  # pause after a failed accept (EMFILE, ENOBUFS) instead of spinning
TARGET_SOFT_FD_LIMIT = 65536


def listening_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Non-blocking sockets listening on every address of `host`, the same port on each (port 0: the others take
    the port the first one got); none is left open when one cannot be bound."""
    listeners: list[socket.socket] = []
    addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does; never SO_REUSEPORT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and listeners:
                address = (address[0], listeners[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
        except OSError:
            sock.close()
            for listener in listeners:
                listener.close()
            raise
        listeners.append(sock)
    return listeners


async def accept_within(
    loop: asyncio.AbstractEventLoop,
    listener: socket.socket,
    slots: asyncio.Semaphore,
    failures: RateLimitedLog,
    failure: str,
) -> tuple[socket.socket, Any]:
    """The next connection on `listener` and its address, holding one of `slots` (the caller releases it when the
    connection ends). At the bound it stops accepting: clients wait in the kernel's backlog. Out of descriptors or
    buffers, it pauses and logs `failure` with the reason once in a while, instead of spinning."""
    while True:
        await slots.acquire()
        try:
            return await loop.sock_accept(listener)
        except OSError as exc:
            slots.release()
            failures.log(f"{failure}: {exc.strerror or exc}")
            await asyncio.sleep(ACCEPT_RETRY_SECONDS)
        except BaseException:
            slots.release()
            raise


def raise_fd_soft_limit(target: int = TARGET_SOFT_FD_LIMIT) -> int:
    """Raise the soft RLIMIT_NOFILE towards `target` (never above the hard limit); the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # not allowed here: keep what we have
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_bound(max_connections: int = DEFAULT_MAX_HTTP_CONNECTIONS) -> int:
    """`max_connections`, lowered so that FD_RESERVE descriptors of the soft limit stay free for the rest even
    when every HTTP-side port (HTTP_PORTS of them) is full."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(MIN_HTTP_CONNECTIONS, min(max_connections, (soft - FD_RESERVE) // HTTP_PORTS))


def grpc_connection_bound(
    max_connections: int = DEFAULT_MAX_GRPC_CONNECTIONS, descriptors_per_connection: int = 1
) -> int:
    """`max_connections` for the gRPC port, lowered so that with it and every HTTP-side port full, OTHER_FD_RESERVE
    descriptors of the soft limit stay free (1024 descriptors: 258 gRPC connections; 86 when each costs three,
    behind the per-address relay, gym_rpc.server._grpc_relay)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return max_connections
    http_side = 2 * connection_bound(DEFAULT_MAX_HTTP_CONNECTIONS) + connection_bound(
        DEFAULT_MAX_CONNECT_CONNECTIONS
    )
    free = (soft - http_side - OTHER_FD_RESERVE) // descriptors_per_connection
    return max(MIN_GRPC_CONNECTIONS, min(max_connections, free))


class BoundedListener:
    """Serve an HTTP server's protocol on listening sockets with at most `max_connections` connections at once."""

    def __init__(
        self, max_connections: int, header_timeout_seconds: float = DEFAULT_HEADER_TIMEOUT_SECONDS
    ) -> None:
        self._protocol_factory: Callable[[], asyncio.Protocol] | None = None
        self._ssl: ssl.SSLContext | None = None
        self._has_request: Callable[[Any], bool] = lambda protocol: False
        self._slots = asyncio.Semaphore(max_connections)
        self.max_connections = max_connections
        self._header_timeout = header_timeout_seconds
        self._connections: dict[Any, _CountedConnection] = {}  # transport -> its connection, while open
        self._tasks: list[asyncio.Task[None]] = []
        self._setups: set[asyncio.Task[None]] = set()  # connections being set up (a TLS handshake, say)
        self._listeners: list[socket.socket] = []
        self._accept_failures = RateLimitedLog(logger)

    @web.middleware
    async def mark_answered(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A middleware: the connection delivered a complete request, so the header deadline no longer applies."""
        connection = self._connections.get(request.transport)
        if connection is not None:
            connection.answered = True
        return await handler(request)

    def listen(self, host: str, port: int) -> int:
        """Bind and listen on every address of `host` (the same port on each); the port bound."""
        self._listeners = listening_sockets(host, port, self.max_connections)
        return int(self._listeners[0].getsockname()[1])

    def start(self, runner: web.AppRunner) -> None:
        """Accept connections for `runner` (set up, its app using `mark_answered`) on the listening sockets."""
        assert runner.server is not None, "the runner is set up before the listener starts"
        self.start_protocol(runner.server)

    def start_protocol(
        self,
        protocol_factory: Callable[[], asyncio.Protocol],
        *,
        ssl_context: ssl.SSLContext | None = None,
        has_request: Callable[[Any], bool] | None = None,
    ) -> None:
        """Accept connections for any HTTP server's protocol; `has_request(protocol)` tells the header deadline
        that a connection delivered a complete request (besides `mark_answered`, for aiohttp apps)."""
        self._protocol_factory, self._ssl = protocol_factory, ssl_context
        if has_request is not None:
            self._has_request = has_request
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._accept(sock), name="gym_rpc http accept") for sock in self._listeners
        ]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._setups]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self.close()

    def close(self) -> None:
        for sock in self._listeners:
            sock.close()
        self._listeners = []

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await accept_within(
                loop, listener, self._slots, self._accept_failures, "HTTP head cannot accept a connection"
            )
            # Set up apart from the accept loop: a TLS handshake waits on the client.
            setup = loop.create_task(self._set_up(connection), name="gym_rpc http connection")
            self._setups.add(setup)
            setup.add_done_callback(self._setups.discard)

    async def _set_up(self, connection: socket.socket) -> None:
        made: list[_CountedConnection] = []
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                functools.partial(self._protocol, made),
                connection,
                ssl=self._ssl,
                ssl_handshake_timeout=self._header_timeout if self._ssl else None,
            )
        except BaseException as exc:  # a failed or timed-out handshake (OSError), or stop() cancelling
            connection.close()
            if not made or made[0].transport is None:  # else its connection_lost gives the slot back
                self._slots.release()
            if not isinstance(exc, OSError):
                raise

    def _protocol(self, made: list[_CountedConnection]) -> _CountedConnection:
        """The server's protocol for one connection, inside one that gives the slot back when the connection
        ends; also appended to `made`, so a failed set-up knows whether it got that far."""
        assert self._protocol_factory is not None
        connection = _CountedConnection(self._protocol_factory(), self)
        made.append(connection)
        asyncio.get_running_loop().call_later(self._header_timeout, connection.drop_if_silent)
        return connection

    def _opened(self, connection: _CountedConnection, transport: asyncio.BaseTransport) -> None:
        self._connections[transport] = connection

    def _closed(self, connection: _CountedConnection) -> None:
        if connection.transport is not None:
            self._connections.pop(connection.transport, None)
        self._slots.release()


class _CountedConnection(asyncio.Protocol):
    """Passes everything to aiohttp's protocol (which has __slots__, so it cannot be wrapped in place) and tells
    the listener when the connection opens and ends."""

    def __init__(self, inner: Any, listener: BoundedListener) -> None:
        self._inner = inner
        self._listener: BoundedListener | None = listener
        self.transport: asyncio.BaseTransport | None = None
        self.answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self._listener is not None:
            self._listener._opened(self, transport)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received()
        return result

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            listener, self._listener = self._listener, None
            if listener is not None:  # once only
                listener._closed(self)

    def drop_if_silent(self) -> None:
        """The header deadline: a connection that has not delivered a complete request yet is closed."""
        listener = self._listener
        if listener is None or self.answered or listener._has_request(self._inner):
            return
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class BoundedSite:
    """An aiohttp app served on host:port through a BoundedListener: what `web.TCPSite` does, bounded."""

    def __init__(self, app: web.Application, request_log: logging.Logger | None = None) -> None:
        """`request_log`: the logger aiohttp's request handler logs to (its own by default)."""
        self._listener = BoundedListener(connection_bound())
        app.middlewares.append(self._listener.mark_answered)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=DEFAULT_KEEPALIVE_TIMEOUT_SECONDS,
            logger=request_log if request_log is not None else server_logger,
        )

    async def start(self, host: str, port: int, *, what: str, setting: str) -> int:
        """The port served. When host:port cannot be bound, a one-line GymRpcError saying `what` could not be
        served and to choose another `setting`."""
        await self._runner.setup()
        try:
            served = self._listener.listen(host.strip("[]"), port)
        except OSError as exc:
            await self._runner.cleanup()
            raise GymRpcError(
                f"cannot serve {what} on {host}:{port}: {exc.strerror or exc}; choose another {setting}"
            ) from exc
        self._listener.start(self._runner)
        return served

    async def stop(self) -> None:
        await self._listener.stop()
        await self._runner.cleanup()
