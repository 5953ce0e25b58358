"""Living with `opentelemetry-instrumentation-aiohttp-client`: when it is active, it already makes a CLIENT span
for every aiohttp request (and injects `traceparent`), so a traced ServerClient must not make a second one; it adds
its own attributes (`gym.server.name`, `gym.rollout_id`, `http.request.resend_count`) to that span instead.

How: sessions made while the instrumentation is active get one more aiohttp TraceConfig of ours, listed before the
instrumentation's. Our hooks run when the request's headers are sent (or it fails), by which time the
instrumentation's span is the current one; the attributes travel in aiohttp's `trace_request_ctx`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import aiohttp
from opentelemetry import trace

INSTRUMENTATION_MODULE = "opentelemetry.instrumentation.aiohttp_client"
_ATTRIBUTES_KEY = "gym_rpc.attributes"
_OUTER_SPAN_KEY = "gym_rpc.outer_span"


def instrumentation_active() -> bool:
    """Whether the aiohttp client instrumentation is on (never imports it: only an application that did can be)."""
    module = sys.modules.get(INSTRUMENTATION_MODULE)
    if module is None:
        return False
    return bool(module.AioHttpClientInstrumentor().is_instrumented_by_opentelemetry)


def session_instrumented(session: aiohttp.ClientSession) -> bool:
    """Whether the instrumentation added its TraceConfig to `session` (it marks it)."""
    # aiohttp's own attribute first: its public `trace_configs` is a property, a Python call more on every call.
    configs: Any = getattr(session, "_trace_configs", None) or getattr(session, "trace_configs", None)
    if not configs:  # every traced call asks: the common answer without a generator
        return False
    return any(getattr(config, "_is_instrumented_by_opentelemetry", False) for config in configs)


async def _add_attributes(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
    request_context = getattr(context, "trace_request_ctx", None)
    if not isinstance(request_context, Mapping) or _ATTRIBUTES_KEY not in request_context:
        return  # not a ServerClient call
    span = trace.get_current_span()
    if span is request_context[_OUTER_SPAN_KEY] or not span.is_recording():
        return  # the instrumentation made no span for this request (an excluded URL, suppressed)
    span.set_attributes(request_context[_ATTRIBUTES_KEY])


def trace_configs() -> list[aiohttp.TraceConfig]:
    """Our TraceConfig for a new session while the instrumentation is active, else none (no cost per request)."""
    if not instrumentation_active():
        return []
    config = aiohttp.TraceConfig()
    config.on_request_headers_sent.append(_add_attributes)
    config.on_request_exception.append(_add_attributes)
    return [config]


def request_context(attributes: MutableMapping[str, Any]) -> dict[str, Any]:
    """The `trace_request_ctx` of one ServerClient call: our attributes (updated in place on resends) and the span
    that was current before the request, which the instrumentation's span must not be mistaken for."""
    return {_ATTRIBUTES_KEY: attributes, _OUTER_SPAN_KEY: trace.get_current_span()}
