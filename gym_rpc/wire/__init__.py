"""The wire layer: what the client and the server agree on, and nothing that runs on either side alone.

* `_convert` (exported as `convert`): the one conversion layer to and from the generated `gym_rpc.v1` messages.
* `_status`: server statuses, status reports, status snapshots and watch events.
* `_errors`: how a failed gRPC call becomes a typed gym_rpc error; unknown names as `google.rpc.Status` details.
* `_paths`: the rollout and trace-context URL path format (builder and parser).
* `_names`: the service name, metadata keys, environment variable names and message-size limits.
* `_labels`: the bounds of instance labels, checked alike by registering servers and the head.

The error classes live one level lower, in `gym_rpc.errors`, so that every layer (config included) can raise them.
"""

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gym_rpc._lazy import lazy_exports
from gym_rpc.wire._labels import MAX_LABEL_KEY_LENGTH, MAX_LABEL_VALUE_LENGTH, MAX_LABELS, label_problem
from gym_rpc.wire._names import (
    AUTHORIZATION_METADATA_KEY,
    CONTROL_METHOD_PREFIX,
    HEAD_ADDRESS_ENV_VAR,
    HEALTH_METHOD_PREFIX,
    HEALTH_SERVICE_NAME,
    MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES,
    MIB,
    SERVICE_NAME,
    TLS_CA_ENV_VAR,
    TLS_CERT_ENV_VAR,
    TLS_KEY_ENV_VAR,
    TOKEN_ENV_VAR,
    WATCH_RELAY_ENV_VAR,
)
from gym_rpc.wire._paths import (
    GYM_PREFIX_HEAD,
    MAX_ROLLOUT_ID_LENGTH,
    MODEL_SERVER_PATHS,
    MODEL_SERVER_TYPE,
    RESOURCES_SERVER_TYPE,
    ROLLOUT_ID_RULE,
    ROLLOUT_SEGMENT,
    TOKEN_CAPTURE_SEGMENT,
    TRACE_SEGMENT,
    TRACEPARENT_HEADER,
    TRACEPARENT_PATTERN,
    TRACEPARENT_RE,
    GymPrefixes,
    encode_rollout_id,
    is_plain_rollout_id,
    prefixed_path,
    rollout_path_prefix,
    split_gym_prefixes,
    trace_path_segment,
)
from gym_rpc.wire._status import (
    ENGINE_LOAD_MAX_AGE_SECONDS,
    SERVER_STATUSES,
    EngineLoad,
    InstanceOrigin,
    InstanceReport,
    RegistrationState,
    ServerStatus,
    StatusReport,
    StatusSnapshot,
    WatchEvent,
)

if TYPE_CHECKING:
    from gym_rpc.wire import _convert as convert
    from gym_rpc.wire._convert import InstanceRegistration, RegisteredInstance, ReportedProcess, ServerInstance
    from gym_rpc.wire._errors import from_grpc_error, status_code, unknown_server_status

# Imported on first use: the generated messages (protobuf) and gRPC's errors. A rollout worker whose config was
# injected builds rollout paths and statuses from this package and need not load either.
_CONVERT_MODULE = "gym_rpc.wire._convert"
_EXPORTS = {
    "InstanceRegistration": _CONVERT_MODULE,
    "RegisteredInstance": _CONVERT_MODULE,
    "ReportedProcess": _CONVERT_MODULE,
    "ServerInstance": _CONVERT_MODULE,
    "from_grpc_error": "gym_rpc.wire._errors",
    "status_code": "gym_rpc.wire._errors",
    "unknown_server_status": "gym_rpc.wire._errors",
}
_lazy_export = lazy_exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "convert":  # the conversion module itself, under its public name
        module: ModuleType = importlib.import_module(_CONVERT_MODULE)
        globals()["convert"] = module
        return module
    return _lazy_export(name)


__all__ = [
    "AUTHORIZATION_METADATA_KEY",
    "CONTROL_METHOD_PREFIX",
    "ENGINE_LOAD_MAX_AGE_SECONDS",
    "GYM_PREFIX_HEAD",
    "HEAD_ADDRESS_ENV_VAR",
    "HEALTH_METHOD_PREFIX",
    "HEALTH_SERVICE_NAME",
    "MAX_LABELS",
    "MAX_LABEL_KEY_LENGTH",
    "MAX_LABEL_VALUE_LENGTH",
    "MAX_REQUEST_BYTES",
    "MAX_RESPONSE_BYTES",
    "MAX_ROLLOUT_ID_LENGTH",
    "MIB",
    "MODEL_SERVER_PATHS",
    "MODEL_SERVER_TYPE",
    "RESOURCES_SERVER_TYPE",
    "ROLLOUT_ID_RULE",
    "ROLLOUT_SEGMENT",
    "SERVER_STATUSES",
    "SERVICE_NAME",
    "TLS_CA_ENV_VAR",
    "TLS_CERT_ENV_VAR",
    "TLS_KEY_ENV_VAR",
    "TOKEN_CAPTURE_SEGMENT",
    "TOKEN_ENV_VAR",
    "TRACEPARENT_HEADER",
    "TRACEPARENT_PATTERN",
    "TRACEPARENT_RE",
    "TRACE_SEGMENT",
    "WATCH_RELAY_ENV_VAR",
    "EngineLoad",
    "GymPrefixes",
    "InstanceOrigin",
    "InstanceRegistration",
    "InstanceReport",
    "RegisteredInstance",
    "RegistrationState",
    "ReportedProcess",
    "ServerInstance",
    "ServerStatus",
    "StatusReport",
    "StatusSnapshot",
    "WatchEvent",
    "convert",
    "encode_rollout_id",
    "from_grpc_error",
    "is_plain_rollout_id",
    "label_problem",
    "prefixed_path",
    "rollout_path_prefix",
    "split_gym_prefixes",
    "status_code",
    "trace_path_segment",
    "unknown_server_status",
]
