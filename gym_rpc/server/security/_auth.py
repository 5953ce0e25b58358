"""Who may talk to the control plane, over what, and how much one client may take (the server's side; the
client's token and TLS are `gym_rpc.client`'s).

* Bearer tokens: with a token configured (`head_server.auth_token`, else `GYM_RPC_TOKEN`), every RPC but the
  standard health service needs `authorization: Bearer <token>`, compared in constant time. The interceptor marks
  authenticated calls (`caller_is_authenticated()`), which is what lets GetGlobalConfig hand out secrets.
* TLS and mutual TLS from `head_server.tls`.
* Bounds: message sizes, concurrent streams, keepalive enforcement and a handshake deadline, so one misbehaving
  client cannot starve the others.

Every server that serves the control plane (the head, the bridge) builds its grpc server through this module, so
all of them get the same rules.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import ssl
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from gym_rpc._environment import environment
from gym_rpc._logging import RateLimitedLog
from gym_rpc.config import (
    HEAD_SERVER_KEY,
    REDACTED,
    GlobalConfig,
    HeadTlsConfig,
    read_file_bytes,
    url_host,
)
from gym_rpc.errors import ConfigError, GymRpcError
from gym_rpc.server.security._connection_limits import HEALTH_PORT_CONNECTIONS
from gym_rpc.server.security._interceptors import Context, Handler, HandlerInterceptor, ServerInterceptor
from gym_rpc.wire import (
    AUTHORIZATION_METADATA_KEY,
    HEALTH_METHOD_PREFIX,
    MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES,
    TOKEN_ENV_VAR,
)

logger = logging.getLogger("gym_rpc.server._security")  # its name from before the move

_BEARER_SCHEME = "bearer"
MAX_CONCURRENT_STREAMS = 128  # per connection
# A fleet: 10,000 follower processes (one watch each) on one head, with room to spare.
DEFAULT_MAX_CONCURRENT_WATCHES = 16384  # per head, across all clients
# Per client IP address: a busy node (256 processes, one watch each) stays far below it, and one client still
# cannot take more than a sixteenth of the head's watches.
DEFAULT_MAX_WATCHES_PER_PEER = 1024

HANDSHAKE_TIMEOUT_SECONDS = 10.0  # the default of HeadOptions.handshake_timeout_seconds
CONNECTION_IDLE_SECONDS = 30.0  # the default of HeadOptions.connection_idle_seconds
MAX_CONNECTION_AGE_SECONDS = 1800.0  # then GOAWAY: the client reconnects (a watch resumes) ...
MAX_CONNECTION_AGE_GRACE_SECONDS = 300.0  # ... and calls still open after this long are cancelled

# The head's side of the bargain: small requests, bounded streams per connection, pings no more often than every
# 10 s while no data flows (a client that pings harder is sent GOAWAY), dead peers noticed by the head's own
# keepalive, a connection that never completes its handshake dropped after 10 s, one without a call for 30 s closed
# (pings do not count), and every connection closed within 35 minutes (GOAWAY at 30, calls cancelled 5 later).
# `server_options` adds the bound on connections and the deadlines a head chose.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
    ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.server_handshake_timeout_ms", round(HANDSHAKE_TIMEOUT_SECONDS * 1000)),
    ("grpc.max_connection_idle_ms", round(CONNECTION_IDLE_SECONDS * 1000)),
    ("grpc.max_connection_age_ms", round(MAX_CONNECTION_AGE_SECONDS * 1000)),
    ("grpc.max_connection_age_grace_ms", round(MAX_CONNECTION_AGE_GRACE_SECONDS * 1000)),
    # Refuse to share the port with another process (grpc allows SO_REUSEPORT by default); SO_REUSEADDR stays
    # on, so a restarted head binds its port again at once.
    ("grpc.so_reuseport", 0),
)


def server_options(
    *,
    max_connections: int,
    handshake_timeout_seconds: float = HANDSHAKE_TIMEOUT_SECONDS,
    connection_idle_seconds: float = CONNECTION_IDLE_SECONDS,
) -> tuple[tuple[str, int], ...]:
    """SERVER_OPTIONS with these deadlines, accepting at most `max_connections` connections at once (grpc closes
    any past it at once: waiting ones would cost a descriptor each)."""
    chosen = {
        "grpc.server_handshake_timeout_ms": round(handshake_timeout_seconds * 1000),
        "grpc.max_connection_idle_ms": round(connection_idle_seconds * 1000),
        "grpc.max_allowed_incoming_connections": max_connections,
    }
    return (*((name, value) for name, value in SERVER_OPTIONS if name not in chosen), *chosen.items())


_authenticated: contextvars.ContextVar[bool] = contextvars.ContextVar("gym_rpc_authenticated", default=False)


def caller_is_authenticated() -> bool:
    """Whether the current RPC presented the configured token (False when no token is configured)."""
    return _authenticated.get()


@dataclass(frozen=True)
class ServerSecurity:
    """How a control-plane server guards its port."""

    token: str | None = field(default=None, repr=False)
    tls: HeadTlsConfig | None = None
    health_port: int | None = None

    @classmethod
    def from_config(cls, config: GlobalConfig) -> ServerSecurity:
        """From `head_server` of the config; the token falls back to GYM_RPC_TOKEN."""
        settings = config.head_settings
        token = head_token(settings.auth_token, f"{HEAD_SERVER_KEY}.auth_token") or _environment_token()
        if settings.tls is not None:
            check_tls_files(settings.tls)
        return cls(token=token, tls=settings.tls, health_port=settings.health_port)

    @classmethod
    def from_environment(cls) -> ServerSecurity:
        """For a server without a head_server block of its own (the bridge): the token of GYM_RPC_TOKEN."""
        return cls(token=_environment_token())

    @property
    def mutual_tls(self) -> bool:
        return self.tls is not None and bool(self.tls.client_ca_file)

    def describe(self) -> str:
        """For the startup banner: what guards the port (never the token itself)."""
        transport = "mutual TLS" if self.mutual_tls else "TLS" if self.tls is not None else "plaintext"
        return f"{transport}, {'token required' if self.token else 'no token'}"

    def interceptors(self) -> list[ServerInterceptor]:
        return [TokenAuthInterceptor(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, host: str, port: int) -> int:
        """Bind `server` to host:port with TLS when configured; the port bound (port 0 picks a free one)."""
        address = f"{url_host(host)}:{port}"
        try:
            if self.tls is None:
                return server.add_insecure_port(address)
            return server.add_secure_port(address, server_credentials(self.tls))
        except RuntimeError as exc:
            raise GymRpcError(f"cannot listen on {address}: {exc}; is another process using the port?") from exc


_PLACEHOLDER_WORDS = {"none", "null", "nil", "changeme", "redacted", "set", "token"}


def head_token(value: str | None, setting: str) -> str | None:
    """The head's token from `setting`: None when not set; a ConfigError when set but blank or a placeholder.

    A blank `auth_token` (`""`, an unset `${oc.env:VAR,""}`) or the `<redacted>` that `gym-rpc config` prints in
    its place would otherwise start a head that authenticates nobody, silently. The value is never echoed.
    """
    if value is None:
        return None
    stripped = value.strip()
    if not stripped:
        raise ConfigError(
            f"{setting} is empty, which would run the head without authentication; set a real token, or remove "
            f"the key to run without one"
        )
    bare = stripped.strip("<>*[]{}() ").lower()
    if stripped.startswith("<") or not bare or bare in _PLACEHOLDER_WORDS or stripped == REDACTED:
        raise ConfigError(
            f"{setting} is a placeholder (such as {REDACTED}, which `gym-rpc config` prints in place of the "
            f"token), not a token; set the real token, or remove the key to run without one"
        )
    return stripped


def _environment_token() -> str | None:
    """GYM_RPC_TOKEN: unset or empty means none (an empty export is how shells unset); a placeholder is refused."""
    value = environment().token
    return head_token(value, TOKEN_ENV_VAR) if value else None


def check_tls_files(tls: HeadTlsConfig) -> None:
    """Refuse a TLS block the head could not serve, naming the file: gRPC would only log C-core lines and fail
    to bind. Read at start and at every reload, so a reload validates exactly as start-up does."""
    if not (tls.cert_file and tls.key_file):
        raise ConfigError(
            f"{HEAD_SERVER_KEY}.tls needs cert_file and key_file for the head to serve TLS "
            f"(refusing to fall back to plaintext)"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for path, setting in ((tls.cert_file, "cert_file"), (tls.key_file, "key_file")):
        read_file_bytes(path, f"{HEAD_SERVER_KEY}.tls.{setting}")  # unreadable: says which file
    try:
        # An encrypted key cannot be served by gRPC: the empty password makes it fail here instead of prompting.
        context.load_cert_chain(tls.cert_file, tls.key_file, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"{HEAD_SERVER_KEY}.tls: {tls.cert_file} (cert_file) and {tls.key_file} (key_file) are not a PEM "
            f"certificate chain and its unencrypted private key ({getattr(exc, 'reason', None) or exc})"
        ) from None
    if tls.client_ca_file:
        read_file_bytes(tls.client_ca_file, f"{HEAD_SERVER_KEY}.tls.client_ca_file")
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"{HEAD_SERVER_KEY}.tls.client_ca_file {tls.client_ca_file} is not a PEM CA certificate "
                f"({getattr(exc, 'reason', None) or exc})"
            ) from None


def server_credentials(tls: HeadTlsConfig) -> grpc.ServerCredentials:
    """TLS credentials of the head; with client_ca_file, clients must present a certificate that CA signed."""
    assert tls.cert_file and tls.key_file, "checked by ServerSecurity.from_config"
    key = read_file_bytes(tls.key_file, f"{HEAD_SERVER_KEY}.tls.key_file")
    chain = read_file_bytes(tls.cert_file, f"{HEAD_SERVER_KEY}.tls.cert_file")
    client_ca = None
    if tls.client_ca_file:
        client_ca = read_file_bytes(tls.client_ca_file, f"{HEAD_SERVER_KEY}.tls.client_ca_file")
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


UNAUTHENTICATED_MESSAGE = (
    "missing or invalid bearer token: send `authorization: Bearer <token>` with the head's token "
    f"(set {TOKEN_ENV_VAR} or {HEAD_SERVER_KEY}.auth_token on the client)"
)


class TokenAuthInterceptor(HandlerInterceptor):
    """Every RPC but the health service needs `authorization: Bearer <token>`; others get UNAUTHENTICATED.

    The comparison takes the same time whatever the presented token shares with the real one, and neither the
    presented token nor the real one ever appears in an answer or a log line (a refusal is one INFO line per 10 s
    at most, naming the method).
    """

    def __init__(self, token: str) -> None:
        self._expected = token.encode()
        self._refusals = RateLimitedLog(logger, level=logging.INFO)  # a caller retrying hard floods no log

    def handle(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        if details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        if not authenticate(details.invocation_metadata, self._expected):
            self._refusals.log(f"refused {details.method}: missing or invalid bearer token")
            return aborting_handler(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        return handler


def authenticate(metadata: Any, expected: bytes) -> bool:
    """Whether the `authorization` entry of `metadata` (key, value pairs) carries the expected bearer token, in
    constant time; when it does, the rest of the current task is an authenticated call (every transport that
    serves the control plane decides here)."""
    presented = _bearer_token(metadata)
    if presented is None or not hmac.compare_digest(presented.encode(), expected):
        return False
    _authenticated.set(True)  # the handler runs in this task's context
    return True


def _bearer_token(metadata: Any) -> str | None:
    """The token of the first `authorization` entry, when it uses the Bearer scheme."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_METADATA_KEY:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == _BEARER_SCHEME else None
    return None


def aborting_handler(handler: Handler, code: grpc.StatusCode, message: str) -> Handler:
    """A handler of the same shape as `handler` that answers `code` with `message` (auth refusals, the bridge's
    UNAVAILABLE while its upstream is down)."""

    async def abort(request: Any, context: Context) -> Any:
        await context.abort(code, message)

    async def abort_stream(request: Any, context: Context) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover (abort raises): makes this an async generator, as a streaming handler is

    # The request is never decoded: a refused caller's bytes are not worth the work, nor a decode error's log.
    codec = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(abort, **codec)


def build_health_server(health_servicer: health_pb2_grpc.HealthServicer) -> grpc.aio.Server:
    """A plaintext server with only the health service, for probes that cannot speak TLS (Kubernetes gRPC)."""
    server = grpc.aio.server(options=server_options(max_connections=HEALTH_PORT_CONNECTIONS))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server
