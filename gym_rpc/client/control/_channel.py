"""Channels to the head: one per head address and TLS setting (and per event loop for grpc.aio), reused by every
caller.

This is the reserved control pool: a dedicated HTTP/2 connection that data-plane traffic never shares. The bearer
token is not part of a channel: clients send it as call metadata (gym_rpc.server.security._auth).
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref

import grpc

from gym_rpc._environment import environment
from gym_rpc._tasks import taken
from gym_rpc.client.control._credentials import CLIENT_MESSAGE_OPTIONS, ClientTls
from gym_rpc.client.nemo_gym import GRPC_TARGET_SCHEMES
from gym_rpc.client.tracing import aio_client_interceptors, traced_sync_channel
from gym_rpc.config import DEFAULT_HEAD_HOST, DEFAULT_HEAD_PORT, parse_head_addresses, parse_host_port, url_host
from gym_rpc.errors import ConfigError
from gym_rpc.telemetry import tracing_enabled
from gym_rpc.wire import HEAD_ADDRESS_ENV_VAR, SERVICE_NAME

DEFAULT_TIMEOUT_SECONDS = 5.0

# Every ControlPlaneService RPC may be retried: most read state, and the ones that change it are idempotent
# (ReloadGlobalConfig re-reads a file; Register/DeregisterServerInstance set or clear one entry).
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE_NAME}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

CHANNEL_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.enable_http_proxy", 0),  # proxy variables must never divert control traffic away from the head
    ("grpc.enable_retries", 1),
    ("grpc.service_config", _SERVICE_CONFIG),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # A connection of its own per channel: gRPC shares one among channels to an address by default, so a channel
    # redialing a head that went away (one of an ended event loop, say) held a newer channel in its backoff, and a
    # head started again on that port was refused to a new client for up to the 2 s above.
    ("grpc.use_local_subchannel_pool", 1),
    *CLIENT_MESSAGE_OPTIONS,
)


def head_address(host: str, port: int) -> str:
    return f"{url_host(host)}:{port}"


def default_head_address() -> str:
    """The head address from GYM_RPC_HEAD, else 127.0.0.1:11000."""
    return environment().head_address or head_address(DEFAULT_HEAD_HOST, DEFAULT_HEAD_PORT)


def checked_head_address(address: str) -> str:
    """`address` when it is HOST:PORT (or an explicit gRPC target such as `unix:PATH`); else a ConfigError saying
    what is expected. gRPC would take `http://h:1` for a host name and answer "Misformatted domain name", and
    `h:99999` for some other port. Several heads come comma-separated (`a:11000,b:11000`), each checked."""
    if address.startswith(GRPC_TARGET_SCHEMES):
        return address
    if "," in address:  # several heads of one deployment (docs/multi-host.md, "Several heads")
        return ",".join(parse_head_addresses(address, f"head addresses (--head or {HEAD_ADDRESS_ENV_VAR})"))
    what = f"head address (--head or {HEAD_ADDRESS_ENV_VAR})"
    _, port = parse_host_port(address, what)
    if not 0 < port < 65536:
        raise ConfigError(f"{what} {address!r}: the port must be in 1..65535")
    return address


def split_head_addresses(address: str) -> tuple[str, ...]:
    """The heads a checked address names: itself, or each of a comma-separated list."""
    return tuple(address.split(",")) if "," in address else (address,)


ChannelKey = tuple[str, ClientTls | None, bool]  # address, TLS, traced (gym_rpc.telemetry)

_sync_channels: dict[ChannelKey, grpc.Channel] = {}
# Keyed by the loop object itself (weakly): a new loop never inherits a channel bound to a dead one.
_aio_channels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[ChannelKey, grpc.aio.Channel]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def sync_channel(address: str, tls: ClientTls | None = None) -> grpc.Channel:
    """The process's blocking channel to `address` (TLS when `tls` is given); usable from any thread, with or
    without an event loop."""
    key = (address, tls, tracing_enabled())
    with _lock:
        channel = _sync_channels.get(key)
        if channel is None:
            if tls is None:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            else:
                options = CHANNEL_OPTIONS + tls.channel_options()
                channel = grpc.secure_channel(address, tls.credentials(), options=options)
            channel = _sync_channels[key] = traced_sync_channel(channel)  # itself when tracing is off
        return channel


def aio_channel(address: str, tls: ClientTls | None = None) -> grpc.aio.Channel:
    """The running event loop's channel to `address` (a grpc.aio channel belongs to one loop)."""
    loop = asyncio.get_running_loop()
    key = (address, tls, tracing_enabled())
    with _lock:
        # A channel holds its loop, so the weak key alone never lets an ended loop go: drop those here.
        for ended in [other for other in _aio_channels if other.is_closed()]:
            del _aio_channels[ended]
        channels = _aio_channels.setdefault(loop, {})
        channel = channels.get(key)
        if channel is None:
            interceptors = aio_client_interceptors() or None  # none when tracing is off
            if tls is None:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
            else:
                options = CHANNEL_OPTIONS + tls.channel_options()
                channel = grpc.aio.secure_channel(
                    address, tls.credentials(), options=options, interceptors=interceptors
                )
            channels[key] = channel
        return channel


async def close_aio_channels() -> None:
    """Close the running loop's channels (call before the loop ends)."""
    with _lock:
        channels = _aio_channels.pop(asyncio.get_running_loop(), {})
    for channel in channels.values():
        await channel.close(None)


def close_sync_channels() -> None:
    for channel in taken(_sync_channels, _lock):
        channel.close()
