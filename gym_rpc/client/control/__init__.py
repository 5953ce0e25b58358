"""The control plane as a client sees it (the head view): the RPC table and the clients made from it, the seam
that picks the gRPC head or NeMo Gym's HTTP head, the shared gRPC channels, the watch, the token and TLS.

Never imported by the data plane (`make lint`); the follower and `ServerClient` join the two. Exports import on
first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_modules

if TYPE_CHECKING:
    from gym_rpc.client.control._channel import DEFAULT_TIMEOUT_SECONDS as DEFAULT_TIMEOUT_SECONDS
    from gym_rpc.client.control._channel import checked_head_address as checked_head_address
    from gym_rpc.client.control._channel import close_aio_channels as close_aio_channels
    from gym_rpc.client.control._channel import close_sync_channels as close_sync_channels
    from gym_rpc.client.control._channel import default_head_address as default_head_address
    from gym_rpc.client.control._channel import head_address as head_address
    from gym_rpc.client.control._clients import ControlClient as ControlClient
    from gym_rpc.client.control._clients import StatusSnapshot as StatusSnapshot
    from gym_rpc.client.control._clients import SyncControlClient as SyncControlClient
    from gym_rpc.client.control._credentials import ClientSecurity as ClientSecurity
    from gym_rpc.client.control._credentials import ClientTls as ClientTls
    from gym_rpc.client.control._credentials import client_security as client_security
    from gym_rpc.client.control._head_view import HeadView as HeadView
    from gym_rpc.client.control._head_view import configured_head_server as configured_head_server
    from gym_rpc.client.control._head_view import injected_config as injected_config
    from gym_rpc.client.control._head_view import injected_head_server as injected_head_server
    from gym_rpc.client.control._heads import head_for as head_for
    from gym_rpc.client.control._watch import StatusWatch as StatusWatch
    from gym_rpc.client.control._watch import SyncStatusWatch as SyncStatusWatch

__getattr__ = lazy_modules(
    __name__,
    {
        "_channel": (
            "checked_head_address close_aio_channels close_sync_channels default_head_address "
            "DEFAULT_TIMEOUT_SECONDS head_address"
        ),
        "_clients": "ControlClient StatusSnapshot SyncControlClient",
        "_credentials": "client_security ClientSecurity ClientTls",
        "_head_view": "configured_head_server HeadView injected_config injected_head_server",
        "_heads": "head_for",
        "_watch": "StatusWatch SyncStatusWatch",
    },
)
