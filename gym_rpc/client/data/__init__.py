"""The data plane: a call to a Gym server, from the pools of aiohttp sessions through its send (resent by
`gym_rpc.client.resend`), its span and metrics, to a replicated server's routed send; the rollout a call carries.

Never imports the control plane (`make lint`): aiohttp comes with the first call, grpc never. Exports import on
first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_modules

if TYPE_CHECKING:
    from gym_rpc.client.data._call_paths import call_rollout as call_rollout
    from gym_rpc.client.data._call_paths import path_rule as path_rule
    from gym_rpc.client.data._call_spans import call_span as call_span
    from gym_rpc.client.data._http import close_http_sessions as close_http_sessions
    from gym_rpc.client.data._http import json_payload as json_payload
    from gym_rpc.client.data._http import send as send
    from gym_rpc.client.data._http_pools import HttpPools as HttpPools
    from gym_rpc.client.data._http_settings import HttpClientSettings as HttpClientSettings
    from gym_rpc.client.data._pipeline import DataPlane as DataPlane
    from gym_rpc.client.data._rollout import RolloutTarget as RolloutTarget
    from gym_rpc.client.data._rollout import apply_rollout_prefix as apply_rollout_prefix
    from gym_rpc.client.data._rollout import current_rollout_id as current_rollout_id
    from gym_rpc.client.data._rollout import rollout_context as rollout_context
    from gym_rpc.client.data._rollout import rollout_headers as rollout_headers
    from gym_rpc.client.data._rollout import rollout_id_in_context as rollout_id_in_context
    from gym_rpc.client.data._rollout import trace_context_path_segment as trace_context_path_segment
    from gym_rpc.client.data._routed_send import send_routed as send_routed
    from gym_rpc.client.data._routed_send import sticky_keys as sticky_keys

__getattr__ = lazy_modules(
    __name__,
    {
        "_call_paths": "call_rollout path_rule",
        "_call_spans": "call_span",
        "_http": "close_http_sessions json_payload send",
        "_http_pools": "HttpPools",
        "_http_settings": "HttpClientSettings",
        "_pipeline": "DataPlane",
        "_rollout": (
            "apply_rollout_prefix current_rollout_id rollout_context rollout_headers rollout_id_in_context "
            "RolloutTarget trace_context_path_segment"
        ),
        "_routed_send": "send_routed sticky_keys",
    },
)
