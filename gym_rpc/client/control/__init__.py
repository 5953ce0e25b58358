"""The control plane as a client sees it (the head view): the RPC table and the clients made from it, the seam
that picks the gRPC head or NeMo Gym's HTTP head, the shared gRPC channels, the watch, the token and TLS.

Never imported by the data plane (`make lint`); the follower and `ServerClient` join the two. Exports import on
first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.client.control._channel import (
        DEFAULT_TIMEOUT_SECONDS,
        checked_head_address,
        close_aio_channels,
        close_sync_channels,
        default_head_address,
        head_address,
    )
    from gym_rpc.client.control._clients import ControlClient, StatusSnapshot, SyncControlClient
    from gym_rpc.client.control._credentials import ClientSecurity, ClientTls, client_security
    from gym_rpc.client.control._head_view import (
        HeadView,
        configured_head_server,
        injected_config,
        injected_head_server,
    )
    from gym_rpc.client.control._heads import head_for
    from gym_rpc.client.control._watch import StatusWatch, SyncStatusWatch

_EXPORTS = {
    "checked_head_address": "gym_rpc.client.control._channel",
    "client_security": "gym_rpc.client.control._credentials",
    "configured_head_server": "gym_rpc.client.control._head_view",
    "ClientSecurity": "gym_rpc.client.control._credentials",
    "ClientTls": "gym_rpc.client.control._credentials",
    "close_aio_channels": "gym_rpc.client.control._channel",
    "close_sync_channels": "gym_rpc.client.control._channel",
    "ControlClient": "gym_rpc.client.control._clients",
    "default_head_address": "gym_rpc.client.control._channel",
    "DEFAULT_TIMEOUT_SECONDS": "gym_rpc.client.control._channel",
    "head_address": "gym_rpc.client.control._channel",
    "head_for": "gym_rpc.client.control._heads",
    "HeadView": "gym_rpc.client.control._head_view",
    "injected_config": "gym_rpc.client.control._head_view",
    "injected_head_server": "gym_rpc.client.control._head_view",
    "StatusSnapshot": "gym_rpc.client.control._clients",
    "StatusWatch": "gym_rpc.client.control._watch",
    "SyncControlClient": "gym_rpc.client.control._clients",
    "SyncStatusWatch": "gym_rpc.client.control._watch",
}
__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "ClientSecurity",
    "ClientTls",
    "ControlClient",
    "HeadView",
    "StatusSnapshot",
    "StatusWatch",
    "SyncControlClient",
    "SyncStatusWatch",
    "checked_head_address",
    "client_security",
    "close_aio_channels",
    "close_sync_channels",
    "configured_head_server",
    "default_head_address",
    "head_address",
    "head_for",
    "injected_config",
    "injected_head_server",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
