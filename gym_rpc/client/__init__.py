"""The client layer: what a rollout worker or a tool imports to talk to a head and to Gym servers.

* `server_client`: `ServerClient` (control plane over gRPC, data plane over aiohttp), the public API page; it
  joins the families below.
* `_endpoints`: a client's name -> URL or route (advertised lookups, override, routes, the follower, selectors);
  `_dict_config`: `global_config_dict`, built on first read.
* `_follower`: each server's instances, followed from the head's watch in the background (its share of the CPU;
  `_relearn_grace`: instances a fresh head has not relearned yet): where the control plane and the replicas meet.
* `data`: the data plane, a call to a Gym server: the aiohttp sessions and `send` (imported on the first call), its
  span and metrics, a replicated server's routed send, the rollout a call carries.
* `control`: the head view: the control-plane clients made from one RPC table, the seam that picks the gRPC head
  or NeMo Gym's HTTP head, the shared gRPC channels, the status watch, the token and TLS a client presents.
* `replicas`: picking one instance of a replicated server per call (routes, pickers, outliers, engines' load).
* `resend`: what a failed call does (failure kinds, budgets by kind, in time and client-wide, one log line).
* `tracing`: OpenTelemetry's hooks under both planes; `nemo_gym`: NeMo Gym's HTTP head and rollout correlation.

`make lint` keeps the families apart: the data plane never imports the control plane, the control plane never the
replicas; the follower, the endpoints (`_endpoints`) and `ServerClient` join them. Nothing here imports
`gym_rpc.server`: a worker never loads head code. Exports import on first use.
"""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc._aiohttp_errors import ServerDroppedError
    from gym_rpc.client._follower import close_instance_followers
    from gym_rpc.client.control import (
        DEFAULT_TIMEOUT_SECONDS,
        ClientSecurity,
        ClientTls,
        ControlClient,
        StatusSnapshot,
        StatusWatch,
        SyncControlClient,
        SyncStatusWatch,
        checked_head_address,
        client_security,
        close_aio_channels,
        close_sync_channels,
        default_head_address,
        head_address,
    )
    from gym_rpc.client.data import (
        HttpClientSettings,
        HttpPools,
        apply_rollout_prefix,
        close_http_sessions,
        current_rollout_id,
        rollout_context,
    )
    from gym_rpc.client.resend import ClientBudget, FailureKind, KindBudget, RetryPolicy
    from gym_rpc.client.server_client import ServerClient

_EXPORTS = {
    "ClientBudget": "gym_rpc.client.resend",
    "ClientSecurity": "gym_rpc.client.control",
    "ClientTls": "gym_rpc.client.control",
    "ControlClient": "gym_rpc.client.control",
    "DEFAULT_TIMEOUT_SECONDS": "gym_rpc.client.control",
    "FailureKind": "gym_rpc.client.resend",
    "HttpClientSettings": "gym_rpc.client.data",
    "HttpPools": "gym_rpc.client.data",
    "KindBudget": "gym_rpc.client.resend",
    "RetryPolicy": "gym_rpc.client.resend",
    "ServerClient": "gym_rpc.client.server_client",
    "ServerDroppedError": "gym_rpc._aiohttp_errors",
    "StatusSnapshot": "gym_rpc.client.control",
    "StatusWatch": "gym_rpc.client.control",
    "SyncControlClient": "gym_rpc.client.control",
    "SyncStatusWatch": "gym_rpc.client.control",
    "apply_rollout_prefix": "gym_rpc.client.data",
    "client_security": "gym_rpc.client.control",
    "checked_head_address": "gym_rpc.client.control",
    "close_aio_channels": "gym_rpc.client.control",
    "close_http_sessions": "gym_rpc.client.data",
    "close_instance_followers": "gym_rpc.client._follower",
    "close_sync_channels": "gym_rpc.client.control",
    "current_rollout_id": "gym_rpc.client.data",
    "default_head_address": "gym_rpc.client.control",
    "head_address": "gym_rpc.client.control",
    "rollout_context": "gym_rpc.client.data",
}
__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "ClientBudget",
    "ClientSecurity",
    "ClientTls",
    "ControlClient",
    "FailureKind",
    "HttpClientSettings",
    "HttpPools",
    "KindBudget",
    "RetryPolicy",
    "ServerClient",
    "ServerDroppedError",
    "StatusSnapshot",
    "StatusWatch",
    "SyncControlClient",
    "SyncStatusWatch",
    "apply_rollout_prefix",
    "checked_head_address",
    "client_security",
    "close_aio_channels",
    "close_http_sessions",
    "close_instance_followers",
    "close_sync_channels",
    "current_rollout_id",
    "default_head_address",
    "head_address",
    "rollout_context",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
