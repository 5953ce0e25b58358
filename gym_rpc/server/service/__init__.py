"""The ControlPlaneService: its handlers (one servicer for gRPC and Connect), grpc.health.v1 with List, and
undecodable requests answered INVALID_ARGUMENT.

Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.server.service._bad_requests import DecodeGuardInterceptor
    from gym_rpc.server.service._health import HealthServicer
    from gym_rpc.server.service._servicer import ControlPlaneServicer, HeadState, add_control_plane_service

_EXPORTS = {
    "add_control_plane_service": "gym_rpc.server.service._servicer",
    "ControlPlaneServicer": "gym_rpc.server.service._servicer",
    "DecodeGuardInterceptor": "gym_rpc.server.service._bad_requests",
    "HeadState": "gym_rpc.server.service._servicer",
    "HealthServicer": "gym_rpc.server.service._health",
}
__all__ = [
    "ControlPlaneServicer",
    "DecodeGuardInterceptor",
    "HeadState",
    "HealthServicer",
    "add_control_plane_service",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
