"""gym_rpc: a typed gRPC control plane and a fast aiohttp data plane for NeMo Gym-style rollout systems."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports
from gym_rpc._version import __version__
from gym_rpc.errors import (
    ConfigError,
    ControlPlaneError,
    GymRpcError,
    HeadTimeoutError,
    HeadUnreachableError,
    ServerUnreachableError,
    UnknownServerError,
)

if TYPE_CHECKING:
    from gym_rpc.client import ServerClient, current_rollout_id, rollout_context
    from gym_rpc.config import BaseServerConfig, GlobalConfig, ServerEntry

__all__ = [
    "BaseServerConfig",
    "ConfigError",
    "ControlPlaneError",
    "GlobalConfig",
    "GymRpcError",
    "HeadTimeoutError",
    "HeadUnreachableError",
    "ServerClient",
    "ServerEntry",
    "ServerUnreachableError",
    "UnknownServerError",
    "__version__",
    "current_rollout_id",
    "rollout_context",
]

# Imported on first use: the client pulls in aiohttp, grpc, OmegaConf and OpenTelemetry, the config pydantic and
# YAML, which `import gym_rpc` alone should not pay for. `gym-rpc` imports this package before it can catch Ctrl-C
# (gym_rpc/__main__.py): a light package keeps that window a few milliseconds.
__getattr__ = lazy_exports(
    __name__,
    {
        "BaseServerConfig": "gym_rpc.config",
        "GlobalConfig": "gym_rpc.config",
        "ServerEntry": "gym_rpc.config",
        "ServerClient": "gym_rpc.client.server_client",
        "current_rollout_id": "gym_rpc.client",
        "rollout_context": "gym_rpc.client",
    },
)
