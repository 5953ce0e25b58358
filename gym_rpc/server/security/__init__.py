"""What the head lets in, and how much of it: the token and TLS (`_auth`), one base for its interceptors, bounds
on connections and slow clients, connections per client address on the gRPC port (`_grpc_relay`), loopback-only
Host names, what a registration may advertise, watch slots per
client and in total.

Imports nothing else of the server. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.server.security._address_policy import AddressPolicy
    from gym_rpc.server.security._auth import (
        CONNECTION_IDLE_SECONDS,
        DEFAULT_MAX_CONCURRENT_WATCHES,
        DEFAULT_MAX_WATCHES_PER_PEER,
        HANDSHAKE_TIMEOUT_SECONDS,
        UNAUTHENTICATED_MESSAGE,
        ServerSecurity,
        aborting_handler,
        authenticate,
        build_health_server,
        caller_is_authenticated,
        server_options,
    )
    from gym_rpc.server.security._connection_limits import (
        DEFAULT_MAX_CONNECT_CONNECTIONS,
        DEFAULT_MAX_GRPC_CONNECTIONS,
        BoundedListener,
        BoundedSite,
        connection_bound,
        grpc_connection_bound,
        raise_fd_soft_limit,
    )
    from gym_rpc.server.security._grpc_relay import (
        DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        DESCRIPTORS_PER_CONNECTION,
        UPSTREAM_HOST,
        GrpcRelay,
        PeerMap,
        relay_source_available,
    )
    from gym_rpc.server.security._host_check import LoopbackHostOnly, bound_to_loopback, loopback_host_only
    from gym_rpc.server.security._interceptors import Context, Handler, HandlerInterceptor, ServerInterceptor
    from gym_rpc.server.security._watch_slots import (
        DEFAULT_STALL_SECONDS,
        WatchSlots,
        client_key,
        peer_address,
        write_all_or_drop,
    )

_EXPORTS = {
    "aborting_handler": "gym_rpc.server.security._auth",
    "AddressPolicy": "gym_rpc.server.security._address_policy",
    "authenticate": "gym_rpc.server.security._auth",
    "bound_to_loopback": "gym_rpc.server.security._host_check",
    "BoundedListener": "gym_rpc.server.security._connection_limits",
    "BoundedSite": "gym_rpc.server.security._connection_limits",
    "build_health_server": "gym_rpc.server.security._auth",
    "caller_is_authenticated": "gym_rpc.server.security._auth",
    "client_key": "gym_rpc.server.security._watch_slots",
    "connection_bound": "gym_rpc.server.security._connection_limits",
    "CONNECTION_IDLE_SECONDS": "gym_rpc.server.security._auth",
    "Context": "gym_rpc.server.security._interceptors",
    "DEFAULT_MAX_CONCURRENT_WATCHES": "gym_rpc.server.security._auth",
    "DEFAULT_MAX_CONNECT_CONNECTIONS": "gym_rpc.server.security._connection_limits",
    "DEFAULT_MAX_CONNECTIONS_PER_ADDRESS": "gym_rpc.server.security._grpc_relay",
    "DESCRIPTORS_PER_CONNECTION": "gym_rpc.server.security._grpc_relay",
    "GrpcRelay": "gym_rpc.server.security._grpc_relay",
    "PeerMap": "gym_rpc.server.security._grpc_relay",
    "relay_source_available": "gym_rpc.server.security._grpc_relay",
    "UPSTREAM_HOST": "gym_rpc.server.security._grpc_relay",
    "DEFAULT_MAX_GRPC_CONNECTIONS": "gym_rpc.server.security._connection_limits",
    "DEFAULT_MAX_WATCHES_PER_PEER": "gym_rpc.server.security._auth",
    "DEFAULT_STALL_SECONDS": "gym_rpc.server.security._watch_slots",
    "grpc_connection_bound": "gym_rpc.server.security._connection_limits",
    "Handler": "gym_rpc.server.security._interceptors",
    "HandlerInterceptor": "gym_rpc.server.security._interceptors",
    "HANDSHAKE_TIMEOUT_SECONDS": "gym_rpc.server.security._auth",
    "loopback_host_only": "gym_rpc.server.security._host_check",
    "LoopbackHostOnly": "gym_rpc.server.security._host_check",
    "peer_address": "gym_rpc.server.security._watch_slots",
    "raise_fd_soft_limit": "gym_rpc.server.security._connection_limits",
    "server_options": "gym_rpc.server.security._auth",
    "ServerInterceptor": "gym_rpc.server.security._interceptors",
    "ServerSecurity": "gym_rpc.server.security._auth",
    "UNAUTHENTICATED_MESSAGE": "gym_rpc.server.security._auth",
    "WatchSlots": "gym_rpc.server.security._watch_slots",
    "write_all_or_drop": "gym_rpc.server.security._watch_slots",
}
__all__ = [
    "CONNECTION_IDLE_SECONDS",
    "DEFAULT_MAX_CONCURRENT_WATCHES",
    "DEFAULT_MAX_CONNECTIONS_PER_ADDRESS",
    "DEFAULT_MAX_CONNECT_CONNECTIONS",
    "DEFAULT_MAX_GRPC_CONNECTIONS",
    "DEFAULT_MAX_WATCHES_PER_PEER",
    "DEFAULT_STALL_SECONDS",
    "DESCRIPTORS_PER_CONNECTION",
    "HANDSHAKE_TIMEOUT_SECONDS",
    "UNAUTHENTICATED_MESSAGE",
    "UPSTREAM_HOST",
    "AddressPolicy",
    "BoundedListener",
    "BoundedSite",
    "Context",
    "GrpcRelay",
    "Handler",
    "HandlerInterceptor",
    "LoopbackHostOnly",
    "PeerMap",
    "ServerInterceptor",
    "ServerSecurity",
    "WatchSlots",
    "aborting_handler",
    "authenticate",
    "bound_to_loopback",
    "build_health_server",
    "caller_is_authenticated",
    "client_key",
    "connection_bound",
    "grpc_connection_bound",
    "loopback_host_only",
    "peer_address",
    "raise_fd_soft_limit",
    "relay_source_available",
    "server_options",
    "write_all_or_drop",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
