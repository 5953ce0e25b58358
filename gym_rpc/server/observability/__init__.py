"""How the head is watched: its metrics and the GET /metrics endpoint, OpenTelemetry's gRPC server interceptor, the
quiet log of malformed HTTP requests.

`head_metrics` is a public module the head's parts record through."""

from gym_rpc.server.observability._grpc_tracing import server_interceptors as server_interceptors
from gym_rpc.server.observability._metrics_endpoint import METRICS_PATH as METRICS_PATH
from gym_rpc.server.observability._metrics_endpoint import AppServer as AppServer
from gym_rpc.server.observability._metrics_endpoint import MetricsServer as MetricsServer
from gym_rpc.server.observability._metrics_endpoint import metrics_handler as metrics_handler
from gym_rpc.server.observability._quiet_http_log import UVICORN_LOGGER as UVICORN_LOGGER
from gym_rpc.server.observability._quiet_http_log import QuietInvalidRequests as QuietInvalidRequests
