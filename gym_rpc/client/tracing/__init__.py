"""OpenTelemetry's hooks under both planes: the gRPC client interceptors (control), living with aiohttp's
instrumentation and an unsampled rollout's headers (data). A data-plane call's own span is
`gym_rpc.client.data`'s.

Imports nothing else of the client. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.client.tracing._aiohttp_instrumentation import (
        instrumentation_active,
        note_instrumented_session,
        request_context,
        session_instrumented,
        trace_configs,
    )
    from gym_rpc.client.tracing._grpc_interceptors import (
        aio_client_interceptors,
        record_config_fetch_span,
        traced_sync_channel,
    )
    from gym_rpc.client.tracing._unsampled_headers import forget_headers, known_headers, remember_headers

_EXPORTS = {
    "aio_client_interceptors": "gym_rpc.client.tracing._grpc_interceptors",
    "forget_headers": "gym_rpc.client.tracing._unsampled_headers",
    "instrumentation_active": "gym_rpc.client.tracing._aiohttp_instrumentation",
    "known_headers": "gym_rpc.client.tracing._unsampled_headers",
    "note_instrumented_session": "gym_rpc.client.tracing._aiohttp_instrumentation",
    "record_config_fetch_span": "gym_rpc.client.tracing._grpc_interceptors",
    "remember_headers": "gym_rpc.client.tracing._unsampled_headers",
    "request_context": "gym_rpc.client.tracing._aiohttp_instrumentation",
    "session_instrumented": "gym_rpc.client.tracing._aiohttp_instrumentation",
    "trace_configs": "gym_rpc.client.tracing._aiohttp_instrumentation",
    "traced_sync_channel": "gym_rpc.client.tracing._grpc_interceptors",
}
__all__ = [
    "aio_client_interceptors",
    "forget_headers",
    "instrumentation_active",
    "known_headers",
    "note_instrumented_session",
    "record_config_fetch_span",
    "remember_headers",
    "request_context",
    "session_instrumented",
    "trace_configs",
    "traced_sync_channel",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
