"""The control plane over the Connect protocol, for callers without gRPC tooling (curl, a browser, a script).

Connect is plain HTTP/1.1: a unary call is `POST /gym_rpc.v1.ControlPlaneService/<Method>` with a JSON or binary
protobuf body, a server stream is a body of length-prefixed messages ending in an end-of-stream message. The
runtime is connectrpc, the Connect project's Python implementation (an ASGI application that also understands
gRPC-Web), served by uvicorn on its own port of the head.

Nothing here answers an RPC itself: every method of the service descriptor is routed to the ControlPlaneServicer
method of the same name, the one the gRPC port calls, through a context that turns the servicer's `abort` into
the Connect error with the same code. The rules are the gRPC port's: with a token configured every call needs
`Authorization: Bearer <token>` (checked by the same function), TLS and mutual TLS from `head_server.tls`, the
same redaction (it happens in the servicer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, NoReturn, cast

import grpc
import uvicorn
from connectrpc.code import Code
from connectrpc.compat import google_protobuf_codecs
from connectrpc.compression.gzip import GzipCompression
from connectrpc.errors import ConnectError, ErrorDetail
from connectrpc.method import IdempotencyLevel, MethodInfo, StreamType
from connectrpc.request import RequestContext
from connectrpc.server import ConnectASGIApplication, Endpoint
from google.rpc import status_pb2
from protobuf.wkt import Any as ConnectAny  # connectrpc's protobuf runtime, not google.protobuf's

from gym_rpc._logging import RateLimitedLog
from gym_rpc._tasks import cancel_and_wait
from gym_rpc.errors import GymRpcError
from gym_rpc.server.http._decode_budget import DecodeBudget
from gym_rpc.server.observability import UVICORN_LOGGER, QuietInvalidRequests
from gym_rpc.server.security import (
    DEFAULT_MAX_CONNECT_CONNECTIONS,
    UNAUTHENTICATED_MESSAGE,
    BoundedListener,
    Context,
    LoopbackHostOnly,
    ServerSecurity,
    authenticate,
    bound_to_loopback,
    client_key,
    connection_bound,
)
from gym_rpc.server.service import ControlPlaneServicer
from gym_rpc.v1 import control_plane_pb2 as pb

logger = logging.getLogger("gym_rpc.server._connect")  # its name from before the move

CONNECT_PORT_KEY = "connect_port"
STATUS_DETAILS_KEY = "grpc-status-details-bin"  # gRPC's trailer for google.rpc.Status details (grpcio-status)
SERVICE = pb.DESCRIPTOR.services_by_name["ControlPlaneService"]
STARTUP_SECONDS = 10.0
# The largest request body the Connect port reads, decompressed: the contract's requests are a few hundred bytes
# (labels of a registration a few KiB), and JSON is parsed on the event loop at ~0.25 ms per KiB.
MAX_CONNECT_REQUEST_BYTES = 64 * 1024
# Open connections (each open watch holds one), fewer when the descriptor limit is low (connection_bound); more
# wait in the kernel's backlog. Watches are bounded by the servicer.
MAX_CONNECTIONS = DEFAULT_MAX_CONNECT_CONNECTIONS
# grpc's CANCELLED is Connect's "canceled"; every other code has the same name in both.
_CONNECT_CODES = {status: Code[status.name] for status in grpc.StatusCode if status.name in Code.__members__}
_CONNECT_CODES[grpc.StatusCode.CANCELLED] = Code.CANCELED


class _ConnectCallContext:
    """What the servicer uses of grpc.aio.ServicerContext, for a call that came over Connect."""

    def __init__(self, ctx: RequestContext[Any, Any]) -> None:
        self._ctx = ctx

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()
    ) -> NoReturn:
        extra: list[ErrorDetail] = []
        for key, value in trailing_metadata:
            if key == STATUS_DETAILS_KEY:  # google.rpc.Status details (a NOT_FOUND's known names): Connect's own
                details_any = status_pb2.Status.FromString(cast(bytes, value)).details
                extra.extend(ErrorDetail(ConnectAny(type_url=d.type_url, value=d.value)) for d in details_any)
            else:
                self._ctx.response_trailers[key] = cast(str, value)
        raise ConnectError(_CONNECT_CODES.get(code, Code.UNKNOWN), details, extra)

    def time_remaining(self) -> float | None:
        """Seconds left of the caller's `Connect-Timeout-Ms`, None without one (as grpc's)."""
        remaining_ms = self._ctx.timeout_ms
        return None if remaining_ms is None else max(0.0, remaining_ms / 1000.0)

    def peer(self) -> str:
        """The caller's address in gRPC's peer format ("ipv4:10.0.0.2:5678", "ipv6:[::1]:5678")."""
        host, _, port = (self._ctx.client_address or "").rpartition(":")
        if not host:
            return "unknown"
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def _context(ctx: RequestContext[Any, Any]) -> Context:
    # The servicer only awaits abort() and reads time_remaining() and peer(): the adapter has exactly those.
    return cast(Context, _ConnectCallContext(ctx))


class _BeforeTheBody:
    """A connectrpc metadata interceptor (connectrpc runs those before it reads a request's body): with a token
    configured, a call without it is refused UNAUTHENTICATED from its headers alone, and a client past its decode
    budget RESOURCE_EXHAUSTED; an accepted call's decoding is charged to its client. Nothing is read, decompressed
    or parsed for a refused call."""

    def __init__(self, token: bytes | None, budget: DecodeBudget) -> None:
        self._token = token
        self._budget = budget
        self._refusals = RateLimitedLog(logger, level=logging.INFO)

    async def on_start(self, ctx: RequestContext[Any, Any]) -> None:
        # authenticate() marks this task authenticated: the handler, later in the same task, sees it.
        if self._token is not None and not authenticate(ctx.request_headers.allitems(), self._token):
            self._refusals.log(f"refused Connect call {ctx.method.name}: missing or invalid bearer token")
            raise ConnectError(Code.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        client = client_key((ctx.client_address or "").rpartition(":")[0])
        refusal = self._budget.refusal(client)
        if refusal is not None:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, refusal)
        self._budget.charge_to(client)

    async def on_end(self, token: None, ctx: RequestContext[Any, Any], error: Exception | None, /) -> None:
        return None


def _unary(
    handler: Callable[[Any, Context], Awaitable[Any]],
) -> Callable[[Any, RequestContext[Any, Any]], Awaitable[Any]]:
    async def call(request: Any, ctx: RequestContext[Any, Any]) -> Any:
        return await handler(request, _context(ctx))

    return call


def _server_stream(
    handler: Callable[[Any, Context], AsyncIterator[Any]],
) -> Callable[[Any, RequestContext[Any, Any]], AsyncIterator[Any]]:
    async def call(request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        # Closed with this generator (the caller went away): the servicer's own clean-up runs at once.
        async with contextlib.aclosing(handler(request, _context(ctx))) as messages:  # type: ignore[type-var]
            async for message in messages:
                yield message

    return call


def endpoints(servicer: ControlPlaneServicer) -> dict[str, Any]:
    """`/<service>/<Method>` -> the servicer's method of that name, for every RPC the contract declares."""
    routes: dict[str, Any] = {}  # Endpoint.unary or Endpoint.server_stream
    for method in SERVICE.methods:
        if method.client_streaming:  # none in v1; a client-streaming RPC needs its own adapter here
            raise TypeError(f"{method.full_name}: client streaming is not served over Connect")
        info: MethodInfo[Any, Any] = MethodInfo(
            name=method.name,
            service_name=SERVICE.full_name,
            input=getattr(pb, method.input_type.name),
            output=getattr(pb, method.output_type.name),
            idempotency_level=IdempotencyLevel.UNKNOWN,
            stream_type=StreamType.SERVER_STREAM if method.server_streaming else StreamType.UNARY,
        )
        handler = getattr(servicer, method.name)
        routes[f"/{SERVICE.full_name}/{method.name}"] = (
            Endpoint.server_stream(info, _server_stream(handler))
            if method.server_streaming
            else Endpoint.unary(info, _unary(handler))
        )
    return routes


class ControlPlaneConnectApplication(ConnectASGIApplication[ControlPlaneServicer]):
    """The ASGI application: ControlPlaneService over Connect (JSON and binary) and gRPC-Web."""

    def __init__(self, servicer: ControlPlaneServicer, token: str | None) -> None:
        routes = endpoints(servicer)  # now, not at the first call: an RPC it cannot serve fails the start
        budget = DecodeBudget()
        super().__init__(
            service=servicer,
            endpoints=lambda service: routes,
            interceptors=[_BeforeTheBody(token.encode() if token else None, budget)],
            read_max_bytes=MAX_CONNECT_REQUEST_BYTES,
            compressions=[budget.compression(GzipCompression())],
            codecs=[budget.codec(codec) for codec in google_protobuf_codecs()],
        )

    @property
    def path(self) -> str:
        return f"/{SERVICE.full_name}"


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside the head's event loop: the head owns the signals (SIGTERM, SIGINT, SIGHUP), not uvicorn,
    and its connections come through a BoundedListener (bounded count, header deadline), not asyncio's server."""

    def __init__(self, config: uvicorn.Config, listener: BoundedListener) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()
        self._listener = listener

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config

        def protocol() -> asyncio.Protocol:
            made: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )
            return made

        self.servers = []
        self._listener.start_protocol(
            protocol,
            ssl_context=config.ssl,
            has_request=lambda made: getattr(made, "cycle", None) is not None,  # h11: a request was parsed
        )
        self.started = True
        self.listening.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._listener.stop()  # accept no more; the open connections are uvicorn's to end
        await super().shutdown(sockets=sockets)


class ConnectServer:
    """The Connect port of a control-plane server. `start()` binds and serves, `stop()` ends in-flight calls
    (watch streams included) within the grace period."""

    def __init__(
        self, servicer: ControlPlaneServicer, security: ServerSecurity, *, shutdown_grace_seconds: float
    ) -> None:
        self._application = ControlPlaneConnectApplication(servicer, security.token)
        self._security = security
        self._grace = shutdown_grace_seconds
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0
        self._quiet = QuietInvalidRequests()  # malformed requests counted, a line per window

    @property
    def scheme(self) -> str:
        return "https" if self._security.tls is not None else "http"

    def _config(self, host: str) -> uvicorn.Config:
        tls = self._security.tls
        # DNS rebinding: a loopback-bound port answers only loopback names (gym_rpc.server.security._host_check).
        application: Any = LoopbackHostOnly(self._application) if bound_to_loopback(host) else self._application
        return uvicorn.Config(
            application,
            lifespan="off",
            http="h11",
            ws="none",
            log_config=None,
            log_level="warning",  # no INFO "Started server process" as "uvicorn.error": the head announces it
            access_log=False,
            server_header=False,
            limit_concurrency=MAX_CONNECTIONS,
            timeout_graceful_shutdown=max(1, math.ceil(self._grace)),
            ssl_certfile=tls.cert_file if tls else None,
            ssl_keyfile=tls.key_file if tls else None,
            ssl_ca_certs=tls.client_ca_file if tls else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca_file else ssl.CERT_NONE,
        )

    async def start(self, host: str, port: int) -> None:
        listener = BoundedListener(connection_bound(MAX_CONNECTIONS))
        try:
            self.port = listener.listen(host.strip("[]"), port)
        except OSError as exc:
            raise GymRpcError(
                f"cannot serve Connect on {host}:{port}: {exc.strerror or exc}; choose another "
                f"head_server.{CONNECT_PORT_KEY} (or --connect-port)"
            ) from exc
        server = _EmbeddedUvicorn(self._config(host), listener)
        task = asyncio.get_running_loop().create_task(server.serve())
        listening = asyncio.ensure_future(server.listening.wait())
        await asyncio.wait({listening, task}, timeout=STARTUP_SECONDS, return_when=asyncio.FIRST_COMPLETED)
        listening.cancel()
        if not server.started:
            task.cancel()
            await listener.stop()
            error: object = "startup timed out"
            try:
                await task
            except asyncio.CancelledError:
                pass
            except (Exception, SystemExit) as exc:  # uvicorn exits when it cannot start (a bad certificate file)
                error = exc
            raise GymRpcError(f"cannot serve Connect on {host}:{port}: {error}")
        self._server, self._task = server, task
        logging.getLogger(UVICORN_LOGGER).addFilter(self._quiet)

    async def stop(self) -> None:
        server, task = self._server, self._task
        if server is None or task is None:
            return
        logging.getLogger(UVICORN_LOGGER).removeFilter(self._quiet)
        self._server = self._task = None
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), self._grace + 5.0)
        except TimeoutError:
            server.force_exit = True
            await cancel_and_wait(task)
