"""NeMo Gym's side of things, read without importing NeMo Gym: its HTTP head (config, instances, the RPC table's
answers from it), which protocol a head speaks, a server's status probe, and its rollout correlation.

Imports nothing else of the client: both planes use it. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_modules

if TYPE_CHECKING:
    from gym_rpc.client.nemo_gym._correlation import SESSION_ID_KEY as SESSION_ID_KEY
    from gym_rpc.client.nemo_gym._correlation import nemo_gym_rollout_id as nemo_gym_rollout_id
    from gym_rpc.client.nemo_gym._correlation import rollout_id_from_run_body as rollout_id_from_run_body
    from gym_rpc.client.nemo_gym._correlation import session_key_from_cookies as session_key_from_cookies
    from gym_rpc.client.nemo_gym._head_answers import assistant_message_header as assistant_message_header
    from gym_rpc.client.nemo_gym._head_answers import global_config as global_config
    from gym_rpc.client.nemo_gym._head_answers import global_config_if_changed as global_config_if_changed
    from gym_rpc.client.nemo_gym._head_answers import head_health as head_health
    from gym_rpc.client.nemo_gym._head_answers import head_server_config as head_server_config
    from gym_rpc.client.nemo_gym._head_answers import server_instances as server_instances
    from gym_rpc.client.nemo_gym._head_answers import server_status as server_status
    from gym_rpc.client.nemo_gym._head_answers import server_statuses as server_statuses
    from gym_rpc.client.nemo_gym._head_answers import unimplemented as unimplemented
    from gym_rpc.client.nemo_gym._head_answers import watch as watch
    from gym_rpc.client.nemo_gym._head_endpoints import NemoGymEndpoints as NemoGymEndpoints
    from gym_rpc.client.nemo_gym._head_protocol import DETECT_TIMEOUT_SECONDS as DETECT_TIMEOUT_SECONDS
    from gym_rpc.client.nemo_gym._head_protocol import GRPC as GRPC
    from gym_rpc.client.nemo_gym._head_protocol import GRPC_TARGET_SCHEMES as GRPC_TARGET_SCHEMES
    from gym_rpc.client.nemo_gym._head_protocol import NEMO_GYM_HTTP as NEMO_GYM_HTTP
    from gym_rpc.client.nemo_gym._head_protocol import HeadProtocol as HeadProtocol
    from gym_rpc.client.nemo_gym._head_protocol import forget_head_protocol as forget_head_protocol
    from gym_rpc.client.nemo_gym._head_protocol import head_protocol as head_protocol
    from gym_rpc.client.nemo_gym._head_protocol import known_head_protocol as known_head_protocol
    from gym_rpc.client.nemo_gym._head_protocol import remembered_head_protocol as remembered_head_protocol
    from gym_rpc.client.nemo_gym._probe import probe as probe

__getattr__ = lazy_modules(
    __name__,
    {
        "_correlation": "nemo_gym_rollout_id rollout_id_from_run_body SESSION_ID_KEY session_key_from_cookies",
        "_head_answers": (
            "assistant_message_header global_config global_config_if_changed head_health head_server_config "
            "server_instances server_status server_statuses unimplemented watch"
        ),
        "_head_endpoints": "NemoGymEndpoints",
        "_head_protocol": (
            "DETECT_TIMEOUT_SECONDS forget_head_protocol GRPC GRPC_TARGET_SCHEMES head_protocol HeadProtocol "
            "known_head_protocol NEMO_GYM_HTTP remembered_head_protocol"
        ),
        "_probe": "probe",
    },
)
