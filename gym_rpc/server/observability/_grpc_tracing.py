"""Tracing of the control-plane server: OpenTelemetry's grpc.aio server interceptor while tracing is on
(`gym_rpc.telemetry` decides), for control-plane calls but watches."""

from __future__ import annotations

from typing import Any

import grpc

from gym_rpc.telemetry import tracing_enabled
from gym_rpc.wire import CONTROL_METHOD_PREFIX, HEALTH_METHOD_PREFIX, TRACEPARENT_HEADER

# A watch is a stream that may stay open for hours: one span for it would tell nothing and end never.
_UNTRACED_CONTROL_METHODS = frozenset({CONTROL_METHOD_PREFIX + "WatchServerStatuses"})


def _server_span_wanted(details: grpc.HandlerCallDetails) -> bool:
    """Control-plane calls but watches; health checks only when they continue a trace (probes would flood)."""
    method = details.method
    if method.startswith(CONTROL_METHOD_PREFIX):
        return method not in _UNTRACED_CONTROL_METHODS
    if method.startswith(HEALTH_METHOD_PREFIX):
        return any(key == TRACEPARENT_HEADER for key, _ in details.invocation_metadata or ())
    return False


def server_interceptors() -> list[grpc.aio.ServerInterceptor[Any, Any]]:
    """OpenTelemetry's grpc.aio server interceptor when tracing is on, else none."""
    if not tracing_enabled():
        return []
    # Imported only while tracing is on: the instrumentation package is slow to import.
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    interceptor = aio_server_interceptor(filter_=_server_span_wanted)  # type: ignore[no-untyped-call]
    return [interceptor]
