"""NeMo Gym's side of things, read without importing NeMo Gym: its HTTP head (config, instances, the RPC table's
answers from it), which protocol a head speaks, a server's status probe, and its rollout correlation.

Imports nothing else of the client: both planes use it. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.client.nemo_gym._correlation import (
        SESSION_ID_KEY,
        nemo_gym_rollout_id,
        rollout_id_from_run_body,
        session_key_from_cookies,
    )
    from gym_rpc.client.nemo_gym._head_answers import (
        assistant_message_header,
        global_config,
        global_config_if_changed,
        head_health,
        head_server_config,
        server_instances,
        server_status,
        server_statuses,
        unimplemented,
        watch,
    )
    from gym_rpc.client.nemo_gym._head_endpoints import NemoGymEndpoints
    from gym_rpc.client.nemo_gym._head_protocol import (
        DETECT_TIMEOUT_SECONDS,
        GRPC,
        GRPC_TARGET_SCHEMES,
        NEMO_GYM_HTTP,
        HeadProtocol,
        forget_head_protocol,
        head_protocol,
        known_head_protocol,
        remembered_head_protocol,
    )
    from gym_rpc.client.nemo_gym._probe import probe

_EXPORTS = {
    "assistant_message_header": "gym_rpc.client.nemo_gym._head_answers",
    "DETECT_TIMEOUT_SECONDS": "gym_rpc.client.nemo_gym._head_protocol",
    "forget_head_protocol": "gym_rpc.client.nemo_gym._head_protocol",
    "global_config": "gym_rpc.client.nemo_gym._head_answers",
    "global_config_if_changed": "gym_rpc.client.nemo_gym._head_answers",
    "GRPC": "gym_rpc.client.nemo_gym._head_protocol",
    "GRPC_TARGET_SCHEMES": "gym_rpc.client.nemo_gym._head_protocol",
    "head_health": "gym_rpc.client.nemo_gym._head_answers",
    "head_protocol": "gym_rpc.client.nemo_gym._head_protocol",
    "head_server_config": "gym_rpc.client.nemo_gym._head_answers",
    "HeadProtocol": "gym_rpc.client.nemo_gym._head_protocol",
    "known_head_protocol": "gym_rpc.client.nemo_gym._head_protocol",
    "NEMO_GYM_HTTP": "gym_rpc.client.nemo_gym._head_protocol",
    "nemo_gym_rollout_id": "gym_rpc.client.nemo_gym._correlation",
    "NemoGymEndpoints": "gym_rpc.client.nemo_gym._head_endpoints",
    "probe": "gym_rpc.client.nemo_gym._probe",
    "remembered_head_protocol": "gym_rpc.client.nemo_gym._head_protocol",
    "rollout_id_from_run_body": "gym_rpc.client.nemo_gym._correlation",
    "server_instances": "gym_rpc.client.nemo_gym._head_answers",
    "server_status": "gym_rpc.client.nemo_gym._head_answers",
    "server_statuses": "gym_rpc.client.nemo_gym._head_answers",
    "SESSION_ID_KEY": "gym_rpc.client.nemo_gym._correlation",
    "session_key_from_cookies": "gym_rpc.client.nemo_gym._correlation",
    "unimplemented": "gym_rpc.client.nemo_gym._head_answers",
    "watch": "gym_rpc.client.nemo_gym._head_answers",
}
__all__ = [
    "DETECT_TIMEOUT_SECONDS",
    "GRPC",
    "GRPC_TARGET_SCHEMES",
    "NEMO_GYM_HTTP",
    "SESSION_ID_KEY",
    "HeadProtocol",
    "NemoGymEndpoints",
    "assistant_message_header",
    "forget_head_protocol",
    "global_config",
    "global_config_if_changed",
    "head_health",
    "head_protocol",
    "head_server_config",
    "known_head_protocol",
    "nemo_gym_rollout_id",
    "probe",
    "remembered_head_protocol",
    "rollout_id_from_run_body",
    "server_instances",
    "server_status",
    "server_statuses",
    "session_key_from_cookies",
    "unimplemented",
    "watch",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
