"""gym_rpc: a typed gRPC control plane and a fast aiohttp data plane for NeMo Gym-style rollout systems."""

from gym_rpc.config import BaseServerConfig, GlobalConfig, ServerEntry
from gym_rpc.errors import ConfigError, ControlPlaneError, GymRpcError, HeadUnreachableError, UnknownServerError

__all__ = [
    "BaseServerConfig",
    "ConfigError",
    "ControlPlaneError",
    "GlobalConfig",
    "GymRpcError",
    "HeadUnreachableError",
    "ServerEntry",
    "UnknownServerError",
]
__version__ = "0.1.0"
