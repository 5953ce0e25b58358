"""gym_rpc: a typed gRPC control plane and a fast aiohttp data plane for NeMo Gym-style rollout systems."""

from typing import TYPE_CHECKING, Any

from gym_rpc.config import BaseServerConfig, GlobalConfig, ServerEntry
from gym_rpc.errors import (
    ConfigError,
    ControlPlaneError,
    GymRpcError,
    HeadUnreachableError,
    ServerUnreachableError,
    UnknownServerError,
)

if TYPE_CHECKING:
    from gym_rpc.client.rollout import current_rollout_id, rollout_context
    from gym_rpc.client.server_client import ServerClient

__all__ = [
    "BaseServerConfig",
    "ConfigError",
    "ControlPlaneError",
    "GlobalConfig",
    "GymRpcError",
    "HeadUnreachableError",
    "ServerClient",
    "ServerEntry",
    "ServerUnreachableError",
    "UnknownServerError",
    "current_rollout_id",
    "rollout_context",
]
__version__ = "0.1.0"

# Imported on first use: the client pulls in aiohttp, grpc, OmegaConf and OpenTelemetry, which `import gym_rpc`
# alone should not pay for.
_LAZY_EXPORTS = {
    "ServerClient": "gym_rpc.client.server_client",
    "current_rollout_id": "gym_rpc.client.rollout",
    "rollout_context": "gym_rpc.client.rollout",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'gym_rpc' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
