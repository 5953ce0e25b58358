"""The ControlPlaneService: its handlers (one servicer for gRPC and Connect), grpc.health.v1 with List, and
undecodable requests answered INVALID_ARGUMENT."""

from gym_rpc.server.service._bad_requests import DecodeGuardInterceptor as DecodeGuardInterceptor
from gym_rpc.server.service._health import HealthServicer as HealthServicer
from gym_rpc.server.service._servicer import ControlPlaneServicer as ControlPlaneServicer
from gym_rpc.server.service._servicer import HeadState as HeadState
from gym_rpc.server.service._servicer import WatchStream as WatchStream
from gym_rpc.server.service._servicer import add_control_plane_service as add_control_plane_service
from gym_rpc.server.service._servicer import add_watch_service as add_watch_service
