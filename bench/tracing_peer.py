"""Tracing's peer (`bench.flag_cost.run_against_peer`): what a user who traces raw aiohttp runs instead of gym_rpc,
`opentelemetry-instrumentation-aiohttp-client` (its instrumentor, `AioHttpClientInstrumentor().instrument()`, as
its documentation shows), under the same SDK provider and sampler as gym_rpc's traced side, around the same raw
aiohttp post as the data-plane rows' baseline (`data=orjson.dumps(body)`, `orjson.loads`).

On: the instrumentation on before the session is made (so the session carries its TraceConfig: a CLIENT span per
request, its `traceparent` header, and the duration histogram on the global meter provider, a no-op one here as
in gym_rpc's traced side), each rollout a span of the application's own made with the SDK's tracer (the parent the
sampler decides on, as gym_rpc's `rollout_context(id, span=True)` is). Off: the same session and rollouts with no
instrumentation and no span.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiohttp
from opentelemetry import trace

from bench.data_plane import PATH, Post, raw_post, raw_session

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.sampling import Sampler

_sessions: list[aiohttp.ClientSession] = []


def install_provider(sampler: Sampler | None = None) -> None:
    """The SDK's provider (its default sampler unless given), batching into an exporter that drops what it gets
    (the network cost of exporting is left out), set as the global one."""
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class DroppingExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))
    trace.set_tracer_provider(provider)


def instrumented_post(port: int, on: bool) -> Post:
    """The raw post, on a session made after the instrumentation was turned on (`on`), else on a plain one."""
    if on:
        from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor

        AioHttpClientInstrumentor().instrument()
    session = raw_session()
    _sessions.append(session)
    return raw_post(session, f"http://127.0.0.1:{port}{PATH}")


async def close() -> None:
    while _sessions:
        await _sessions.pop().close()


def rollout_span(on: bool) -> contextlib.AbstractContextManager[object]:
    """A rollout's span of the application's own, current while its calls run (on), or nothing (off)."""
    if not on:
        return contextlib.nullcontext()
    return trace.get_tracer("bench.tracing_peer").start_as_current_span("rollout")
