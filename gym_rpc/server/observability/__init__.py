"""How the head is watched: its metrics and the GET /metrics endpoint, OpenTelemetry's gRPC server interceptor, the
quiet log of malformed HTTP requests.

Exports import on first use; `head_metrics` is a public module the head's parts record through."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.server.observability._grpc_tracing import server_interceptors
    from gym_rpc.server.observability._metrics_endpoint import (
        METRICS_PATH,
        AppServer,
        MetricsServer,
        metrics_handler,
    )
    from gym_rpc.server.observability._quiet_http_log import UVICORN_LOGGER, QuietInvalidRequests

_EXPORTS = {
    "AppServer": "gym_rpc.server.observability._metrics_endpoint",
    "metrics_handler": "gym_rpc.server.observability._metrics_endpoint",
    "METRICS_PATH": "gym_rpc.server.observability._metrics_endpoint",
    "MetricsServer": "gym_rpc.server.observability._metrics_endpoint",
    "QuietInvalidRequests": "gym_rpc.server.observability._quiet_http_log",
    "server_interceptors": "gym_rpc.server.observability._grpc_tracing",
    "UVICORN_LOGGER": "gym_rpc.server.observability._quiet_http_log",
}
__all__ = [
    "METRICS_PATH",
    "UVICORN_LOGGER",
    "AppServer",
    "MetricsServer",
    "QuietInvalidRequests",
    "metrics_handler",
    "server_interceptors",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
