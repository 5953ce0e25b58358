"""OpenTelemetry's hooks under both planes: the gRPC client interceptors (control), living with aiohttp's
instrumentation and an unsampled rollout's headers (data). A data-plane call's own span is
`gym_rpc.client.data`'s.

Imports nothing else of the client. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_modules

if TYPE_CHECKING:
    from gym_rpc.client.tracing._aiohttp_instrumentation import instrumentation_active as instrumentation_active
    from gym_rpc.client.tracing._aiohttp_instrumentation import (
        note_instrumented_session as note_instrumented_session,
    )
    from gym_rpc.client.tracing._aiohttp_instrumentation import request_context as request_context
    from gym_rpc.client.tracing._aiohttp_instrumentation import session_instrumented as session_instrumented
    from gym_rpc.client.tracing._aiohttp_instrumentation import trace_configs as trace_configs
    from gym_rpc.client.tracing._grpc_interceptors import aio_client_interceptors as aio_client_interceptors
    from gym_rpc.client.tracing._grpc_interceptors import record_config_fetch_span as record_config_fetch_span
    from gym_rpc.client.tracing._grpc_interceptors import traced_sync_channel as traced_sync_channel
    from gym_rpc.client.tracing._unsampled_headers import forget_headers as forget_headers
    from gym_rpc.client.tracing._unsampled_headers import known_headers as known_headers
    from gym_rpc.client.tracing._unsampled_headers import remember_headers as remember_headers

__getattr__ = lazy_modules(
    __name__,
    {
        "_aiohttp_instrumentation": (
            "instrumentation_active note_instrumented_session request_context session_instrumented trace_configs"
        ),
        "_grpc_interceptors": "aio_client_interceptors record_config_fetch_span traced_sync_channel",
        "_unsampled_headers": "forget_headers known_headers remember_headers",
    },
)
