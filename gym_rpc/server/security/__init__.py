"""What the head lets in, and how much of it: the token and TLS (`_auth`), one base for its interceptors, bounds
on connections and slow clients, connections per client address on the gRPC port (`_grpc_relay`), loopback-only
Host names, what a registration may advertise, watch slots per client and in total.

Imports nothing else of the server."""

from gym_rpc.server.security._address_policy import AddressPolicy as AddressPolicy
from gym_rpc.server.security._auth import CONNECTION_IDLE_SECONDS as CONNECTION_IDLE_SECONDS
from gym_rpc.server.security._auth import DEFAULT_MAX_CONCURRENT_WATCHES as DEFAULT_MAX_CONCURRENT_WATCHES
from gym_rpc.server.security._auth import DEFAULT_MAX_WATCHES_PER_PEER as DEFAULT_MAX_WATCHES_PER_PEER
from gym_rpc.server.security._auth import HANDSHAKE_TIMEOUT_SECONDS as HANDSHAKE_TIMEOUT_SECONDS
from gym_rpc.server.security._auth import UNAUTHENTICATED_MESSAGE as UNAUTHENTICATED_MESSAGE
from gym_rpc.server.security._auth import ServerSecurity as ServerSecurity
from gym_rpc.server.security._auth import aborting_handler as aborting_handler
from gym_rpc.server.security._auth import authenticate as authenticate
from gym_rpc.server.security._auth import build_health_server as build_health_server
from gym_rpc.server.security._auth import caller_is_authenticated as caller_is_authenticated
from gym_rpc.server.security._auth import server_options as server_options
from gym_rpc.server.security._connection_limits import (
    DEFAULT_MAX_CONNECT_CONNECTIONS as DEFAULT_MAX_CONNECT_CONNECTIONS,
)
from gym_rpc.server.security._connection_limits import DEFAULT_MAX_GRPC_CONNECTIONS as DEFAULT_MAX_GRPC_CONNECTIONS
from gym_rpc.server.security._connection_limits import BoundedListener as BoundedListener
from gym_rpc.server.security._connection_limits import BoundedSite as BoundedSite
from gym_rpc.server.security._connection_limits import connection_bound as connection_bound
from gym_rpc.server.security._connection_limits import grpc_connection_bound as grpc_connection_bound
from gym_rpc.server.security._connection_limits import raise_fd_soft_limit as raise_fd_soft_limit
from gym_rpc.server.security._grpc_relay import (
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS as DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
)
from gym_rpc.server.security._grpc_relay import DESCRIPTORS_PER_CONNECTION as DESCRIPTORS_PER_CONNECTION
from gym_rpc.server.security._grpc_relay import UPSTREAM_HOST as UPSTREAM_HOST
from gym_rpc.server.security._grpc_relay import GrpcRelay as GrpcRelay
from gym_rpc.server.security._grpc_relay import PeerMap as PeerMap
from gym_rpc.server.security._grpc_relay import relay_source_available as relay_source_available
from gym_rpc.server.security._host_check import LoopbackHostOnly as LoopbackHostOnly
from gym_rpc.server.security._host_check import bound_to_loopback as bound_to_loopback
from gym_rpc.server.security._host_check import loopback_host_only as loopback_host_only
from gym_rpc.server.security._interceptors import Context as Context
from gym_rpc.server.security._interceptors import Handler as Handler
from gym_rpc.server.security._interceptors import HandlerInterceptor as HandlerInterceptor
from gym_rpc.server.security._interceptors import ServerInterceptor as ServerInterceptor
from gym_rpc.server.security._watch_slots import DEFAULT_STALL_SECONDS as DEFAULT_STALL_SECONDS
from gym_rpc.server.security._watch_slots import BoundedWrites as BoundedWrites
from gym_rpc.server.security._watch_slots import WatchSlots as WatchSlots
from gym_rpc.server.security._watch_slots import client_key as client_key
from gym_rpc.server.security._watch_slots import peer_address as peer_address
from gym_rpc.server.security._watch_slots import write_all_or_drop as write_all_or_drop
