"""The client layer: what a rollout worker or a tool imports to talk to a head and to Gym servers.

* `server_client`: `ServerClient` (control plane over gRPC, data plane over aiohttp), the public API page.
* `_control`: the blocking and async control-plane clients; `_channel`: their shared, tuned gRPC channels.
* `_security`: the bearer token and TLS a client presents; `_tracing`: OpenTelemetry on the control channels.
* `_watch`: a status watch that reconnects and resumes by itself (`StatusWatch`, `SyncStatusWatch`).
* `_http`: the data plane's sessions and `send` (aiohttp, imported on the first data-plane call); `_http_pools`,
  `_http_settings`: what a client holds of them before that; `_resend`, `_resend_policy`, `_resend_budget`,
  `_failures`, `_resend_log`: what a failed call does (budgets by kind and in time, the client-wide budget, one log
  line per server per interval); `_rollout`: the current rollout id; `_unsampled_headers`: the traceparent headers
  an unsampled rollout's calls share; `_call_paths`: where a call carries its rollout (path or header).
* `_routed`, `_routing`, `_picker`, `_prompt_key`, `_outliers`, `_instances`: picking one instance of a replicated
  server per call; `_follower`: each server's instances, followed from the head's watch in the background
  (`_cpu_budget`: its share of the CPU); `_engine_loads`: the engines' load the head pushes, as a picker reads it.

Nothing here imports `gym_rpc.server`: a worker never loads head code. Exports import on first use.
"""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc._aiohttp_errors import ServerDroppedError
    from gym_rpc.client._channel import (
        DEFAULT_TIMEOUT_SECONDS,
        checked_head_address,
        close_aio_channels,
        close_sync_channels,
        default_head_address,
        head_address,
    )
    from gym_rpc.client._control import ControlClient, StatusSnapshot, SyncControlClient
    from gym_rpc.client._follower import close_instance_followers
    from gym_rpc.client._http import close_http_sessions
    from gym_rpc.client._http_pools import HttpPools
    from gym_rpc.client._http_settings import HttpClientSettings
    from gym_rpc.client._resend_policy import ClientBudget, FailureKind, KindBudget, RetryPolicy
    from gym_rpc.client._rollout import apply_rollout_prefix, current_rollout_id, rollout_context
    from gym_rpc.client._security import ClientSecurity, ClientTls, client_security
    from gym_rpc.client._watch import StatusWatch, SyncStatusWatch
    from gym_rpc.client.server_client import ServerClient

_EXPORTS = {
    "ClientBudget": "gym_rpc.client._resend_policy",
    "ClientSecurity": "gym_rpc.client._security",
    "ClientTls": "gym_rpc.client._security",
    "ControlClient": "gym_rpc.client._control",
    "DEFAULT_TIMEOUT_SECONDS": "gym_rpc.client._channel",
    "FailureKind": "gym_rpc.client._resend_policy",
    "HttpClientSettings": "gym_rpc.client._http_settings",
    "HttpPools": "gym_rpc.client._http_pools",
    "KindBudget": "gym_rpc.client._resend_policy",
    "RetryPolicy": "gym_rpc.client._resend_policy",
    "ServerClient": "gym_rpc.client.server_client",
    "ServerDroppedError": "gym_rpc._aiohttp_errors",
    "StatusSnapshot": "gym_rpc.client._control",
    "StatusWatch": "gym_rpc.client._watch",
    "SyncControlClient": "gym_rpc.client._control",
    "SyncStatusWatch": "gym_rpc.client._watch",
    "apply_rollout_prefix": "gym_rpc.client._rollout",
    "client_security": "gym_rpc.client._security",
    "checked_head_address": "gym_rpc.client._channel",
    "close_aio_channels": "gym_rpc.client._channel",
    "close_http_sessions": "gym_rpc.client._http",
    "close_instance_followers": "gym_rpc.client._follower",
    "close_sync_channels": "gym_rpc.client._channel",
    "current_rollout_id": "gym_rpc.client._rollout",
    "default_head_address": "gym_rpc.client._channel",
    "head_address": "gym_rpc.client._channel",
    "rollout_context": "gym_rpc.client._rollout",
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
