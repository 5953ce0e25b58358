"""Tracing of the client's control channels: OpenTelemetry's gRPC client interceptors while tracing is on
(`gym_rpc.telemetry` decides), nothing at all while it is off."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from gym_rpc.telemetry import tracing_enabled

logger = logging.getLogger("gym_rpc.client._tracing")  # its name from before the move: filters keep working


@functools.cache
def _instrumented() -> bool:
    """Whether OpenTelemetry's gRPC instrumentation is installed (the `tracing` extra); said once when not."""
    try:
        import opentelemetry.instrumentation.grpc  # noqa: F401
    except ImportError:
        logger.warning(
            "tracing is on but opentelemetry-instrumentation-grpc is not installed: control calls are not traced "
            "(pip install 'gym-rpc[tracing]')"
        )
        return False
    return True


def _is_stream(client_info: Any) -> bool:
    return bool(getattr(client_info, "is_server_stream", False) or getattr(client_info, "is_client_stream", False))


def traced_sync_channel(channel: grpc.Channel) -> grpc.Channel:
    """`channel` with OpenTelemetry's client interceptor on unary calls (streams stay plain: a watch is long-lived
    and its call object must keep `cancel()`); the channel itself when tracing is off."""
    if not tracing_enabled() or not _instrumented():
        return channel
    # Imported only while tracing is on: the instrumentation package is slow to import.
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    interceptor = client_interceptor(filter_=lambda info: not _is_stream(info))  # type: ignore[no-untyped-call]
    traced: grpc.Channel = intercept_channel(channel, interceptor)  # type: ignore[no-untyped-call]
    return traced


def aio_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """OpenTelemetry's unary-unary grpc.aio client interceptor when tracing is on, else none."""
    if not tracing_enabled() or not _instrumented():
        return []
    # Imported only while tracing is on: the instrumentation package is slow to import.
    from opentelemetry.instrumentation.grpc import aio_client_interceptors as otel_interceptors

    interceptors: Sequence[grpc.aio.ClientInterceptor] = otel_interceptors()  # type: ignore[no-untyped-call]
    return [i for i in interceptors if isinstance(i, grpc.aio.UnaryUnaryClientInterceptor)]


def record_config_fetch_span(address: str, started_ns: int, ended_ns: int) -> None:
    """The span of a process's first GetGlobalConfig, recorded after the call.

    Tracing is decided with the config's `observability_enabled`, which only that call brings: the call itself
    ran on an untraced channel. So it is recorded once the decision is "on", with its real start and end, named
    and attributed as OpenTelemetry's gRPC instrumentation names its spans (its context never reached the head).
    """
    from opentelemetry import trace

    from gym_rpc.telemetry import instrumentation_failed, tracer
    from gym_rpc.wire import SERVICE_NAME

    host, _, port = address.rpartition(":")
    attributes: dict[str, str | int | bool] = {
        "rpc.system": "grpc",
        "rpc.service": SERVICE_NAME,
        "rpc.method": "GetGlobalConfig",
        "rpc.grpc.status_code": 0,
        "server.address": host.strip("[]"),
        "server.port": int(port) if port.isdigit() else 0,
        "gym.recorded_after_the_call": True,
    }
    name, kind = f"/{SERVICE_NAME}/GetGlobalConfig", trace.SpanKind.CLIENT
    try:
        tracer().start_span(name, kind=kind, start_time=started_ns, attributes=attributes).end(end_time=ended_ns)
    except Exception as error:  # the fetch itself succeeded: its span may fail, the client may not
        instrumentation_failed("tracing", error)
