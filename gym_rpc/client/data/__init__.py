"""The data plane: a call to a Gym server, from the pools of aiohttp sessions through its send (resent by
`gym_rpc.client.resend`), its span and metrics, to a replicated server's routed send; the rollout a call carries.

Never imports the control plane (`make lint`): aiohttp comes with the first call, grpc never. Exports import on
first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.client.data._call_metrics import metered_send
    from gym_rpc.client.data._call_paths import path_rule
    from gym_rpc.client.data._call_spans import call_span
    from gym_rpc.client.data._http import close_http_sessions, json_payload, send
    from gym_rpc.client.data._http_pools import HttpPools
    from gym_rpc.client.data._http_settings import HttpClientSettings
    from gym_rpc.client.data._pipeline import DataPlane
    from gym_rpc.client.data._rollout import (
        RolloutTarget,
        apply_rollout_prefix,
        current_rollout_id,
        rollout_context,
        rollout_headers,
        rollout_id_in_context,
        trace_context_path_segment,
    )
    from gym_rpc.client.data._routed_send import send_routed, sticky_keys

_EXPORTS = {
    "apply_rollout_prefix": "gym_rpc.client.data._rollout",
    "call_span": "gym_rpc.client.data._call_spans",
    "close_http_sessions": "gym_rpc.client.data._http",
    "current_rollout_id": "gym_rpc.client.data._rollout",
    "DataPlane": "gym_rpc.client.data._pipeline",
    "HttpClientSettings": "gym_rpc.client.data._http_settings",
    "HttpPools": "gym_rpc.client.data._http_pools",
    "json_payload": "gym_rpc.client.data._http",
    "metered_send": "gym_rpc.client.data._call_metrics",
    "path_rule": "gym_rpc.client.data._call_paths",
    "rollout_context": "gym_rpc.client.data._rollout",
    "rollout_headers": "gym_rpc.client.data._rollout",
    "rollout_id_in_context": "gym_rpc.client.data._rollout",
    "RolloutTarget": "gym_rpc.client.data._rollout",
    "send": "gym_rpc.client.data._http",
    "send_routed": "gym_rpc.client.data._routed_send",
    "sticky_keys": "gym_rpc.client.data._routed_send",
    "trace_context_path_segment": "gym_rpc.client.data._rollout",
}
__all__ = [
    "DataPlane",
    "HttpClientSettings",
    "HttpPools",
    "RolloutTarget",
    "apply_rollout_prefix",
    "call_span",
    "close_http_sessions",
    "current_rollout_id",
    "json_payload",
    "metered_send",
    "path_rule",
    "rollout_context",
    "rollout_headers",
    "rollout_id_in_context",
    "send",
    "send_routed",
    "sticky_keys",
    "trace_context_path_segment",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
