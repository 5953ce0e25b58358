"""Living with `opentelemetry-instrumentation-aiohttp-client`: when it is active, it already makes a CLIENT span
for every aiohttp request (and injects `traceparent`), so a traced ServerClient must not make a second one; it adds
its own attributes (`gym.server.name`, `gym.rollout_id`, `http.request.resend_count`) to that span instead.

How, on public API only: whether the instrumentation is on is its instrumentor's public
`is_instrumented_by_opentelemetry`; while it is on, every new aiohttp session gets its TraceConfig. So gym_rpc
decides once, when it makes a session: a session made while the instrumentation was on is traced by it for its
whole life (as the instrumentation itself goes on tracing such a session after `uninstrument()`), and gets one
more TraceConfig of ours. Our hooks run when the request's headers are sent (or it fails), by which time the
instrumentation's span is the current one; the attributes travel in aiohttp's `trace_request_ctx`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any

import aiohttp
from opentelemetry import trace

from gym_rpc.telemetry import instrumentation_failed

INSTRUMENTATION_MODULE = "opentelemetry.instrumentation.aiohttp_client"
_ATTRIBUTES_KEY = "gym_rpc.attributes"
_OUTER_SPAN_KEY = "gym_rpc.outer_span"

# The sessions gym_rpc made while the instrumentation was on (weakly: a closed, dropped session leaves).
_instrumented_sessions: weakref.WeakSet[aiohttp.ClientSession] = weakref.WeakSet()
_any_instrumented = False  # whether any was noted: the common case (no instrumentation) costs one name lookup


def instrumentation_active() -> bool:
    """Whether the aiohttp client instrumentation is on (never imports it: only an application that did can be)."""
    module = sys.modules.get(INSTRUMENTATION_MODULE)
    if module is None:
        return False
    return bool(module.AioHttpClientInstrumentor().is_instrumented_by_opentelemetry)


def note_instrumented_session(session: aiohttp.ClientSession) -> None:
    """Remember `session` as one the instrumentation traces (gym_rpc made it while the instrumentation was on)."""
    global _any_instrumented
    _instrumented_sessions.add(session)
    _any_instrumented = True


def session_instrumented(session: aiohttp.ClientSession) -> bool:
    """Whether the instrumentation traces `session`, as decided when gym_rpc made it."""
    return _any_instrumented and session in _instrumented_sessions


async def _add_attributes(session: aiohttp.ClientSession, context: Any, params: Any) -> None:
    request_context = getattr(context, "trace_request_ctx", None)
    if not isinstance(request_context, Mapping) or _ATTRIBUTES_KEY not in request_context:
        return  # not a ServerClient call
    try:
        span = trace.get_current_span()
        if span is request_context[_OUTER_SPAN_KEY] or not span.is_recording():
            return  # the instrumentation made no span for this request (an excluded URL, suppressed)
        span.set_attributes(request_context[_ATTRIBUTES_KEY])
    except Exception as error:  # runs inside aiohttp's request: it must never fail the call
        instrumentation_failed("tracing", error)


def trace_configs() -> list[aiohttp.TraceConfig]:
    """Our TraceConfig, for a session made while the instrumentation is on."""
    config = aiohttp.TraceConfig()
    config.on_request_headers_sent.append(_add_attributes)
    config.on_request_exception.append(_add_attributes)
    return [config]


def request_context(attributes: MutableMapping[str, Any]) -> dict[str, Any]:
    """The `trace_request_ctx` of one ServerClient call: our attributes (updated in place on resends) and the span
    that was current before the request, which the instrumentation's span must not be mistaken for."""
    return {_ATTRIBUTES_KEY: attributes, _OUTER_SPAN_KEY: trace.get_current_span()}
