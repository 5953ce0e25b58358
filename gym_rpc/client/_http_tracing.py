"""A traced data-plane call: `send` as one CLIENT span whose context goes out in the `traceparent` header.

It runs on every call of a traced worker, so it does as little as it can around the SDK's span (measured by the
`tracing` rows of `make bench`): the static attributes of a (method, server) pair are built once; and with the
default propagators (W3C trace context and baggage) and no baggage or trace state to carry, the `traceparent`
value is formatted directly, the very string the propagator writes, without building a context for it. Any other
propagator, baggage or trace state goes through `opentelemetry.propagate` as usual.

Sampling is decided once per rollout: under a parent-based sampler (the SDK's default) a call whose parent span,
e.g. its rollout's (`rollout_context(id, span=True)`), was not sampled could only get an unsampled span, so it
gets none: it carries the parent's context on (unsampled, so the receiving server records nothing either) and
costs almost nothing. A rollout sampled at 1 in 10 costs a tenth of a traced one.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from gym_rpc.client._aiohttp_instrumentation import request_context as instrumentation_request_context
from gym_rpc.client._aiohttp_instrumentation import session_instrumented
from gym_rpc.client._http import ObservedCall
from gym_rpc.client._rollout import current_rollout_id
from gym_rpc.client._sdk_spans import DIRECT, DROP, SDK, ClientSpan, span_plan
from gym_rpc.telemetry import (
    ROLLOUT_ID_ATTRIBUTE,
    SERVER_ADDRESS,
    SERVER_NAME_ATTRIBUTE,
    SERVER_PORT,
    URL_FULL,
    SpanRecorder,
    method_attributes,
    propagation,
    record_failure,
    set_response_status,
    span_name,
    tracer,
)

HTTP_REQUEST_RESEND_COUNT = "http.request.resend_count"  # OpenTelemetry http semantic conventions
TRACEPARENT_HEADER = "traceparent"
_CLIENT = trace.SpanKind.CLIENT


@functools.lru_cache(maxsize=1024)
def _static_attributes(method: str, base_url: str, server_name: str) -> tuple[str, Mapping[str, Any]]:
    """The span name and the attributes every call of `method` to `server_name` at `base_url` shares (shared:
    callers copy them)."""
    parts = urlsplit(base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    attributes = {
        **method_attributes(method),
        SERVER_ADDRESS: parts.hostname or "",
        SERVER_PORT: port,
        SERVER_NAME_ATTRIBUTE: server_name,
    }
    return span_name(method), attributes


@functools.lru_cache(maxsize=8)
def _is_default_propagator(propagator: TextMapPropagator) -> bool:
    """Whether the global propagator is OpenTelemetry's default (W3C trace context, then W3C baggage), keyed by the
    propagator object, so `set_global_textmap` with another one is noticed."""
    from opentelemetry.baggage.propagation import W3CBaggagePropagator

    parts = getattr(propagator, "_propagators", None) if type(propagator) is CompositePropagator else None
    return parts is not None and [type(part) for part in parts] in (
        [TraceContextTextMapPropagator, W3CBaggagePropagator],
        [TraceContextTextMapPropagator],
    )


def trace_context_headers(
    given: Any, context: trace.SpanContext, current: Context | None = None, carries_baggage: bool | None = None
) -> MutableMapping[str, str]:
    """A copy of the caller's headers (never touched) carrying `context`, ours replacing any traceparent, and the
    baggage of `current` (the current context by default; `carries_baggage` when the caller knows)."""
    headers: MutableMapping[str, str] = CIMultiDict(given) if given else {}
    propagate = propagation()
    default = _is_default_propagator(propagate.get_global_textmap())
    if carries_baggage is None:
        carries_baggage = bool(baggage.get_all(current))
    state = context.trace_state
    if default and (state is DEFAULT_TRACE_STATE or not state) and not carries_baggage:
        ids = (context.trace_id, context.span_id, context.trace_flags)
        headers[TRACEPARENT_HEADER] = "00-%032x-%016x-%02x" % ids  # noqa: UP031 (here faster than an f-string)
    else:
        carried = trace.set_span_in_context(trace.NonRecordingSpan(context), current)
        propagate.inject(headers, context=carried)
    return headers


_last_inherited: tuple[Callable[[], Context | None], trace.SpanContext, bool] = (
    lambda: None, trace.INVALID_SPAN_CONTEXT, False,
)  # fmt: skip


def _inherited(current: Context) -> tuple[trace.SpanContext, bool]:
    """The current span's context (a call's parent) and whether `current` carries baggage. Contexts are immutable
    and a rollout's calls share one, so the answer is remembered for the last (weakly: it is not kept alive)."""
    global _last_inherited
    last = _last_inherited
    if last[0]() is not current:
        parent = trace.get_current_span(current).get_span_context()
        last = _last_inherited = (weakref.ref(current), parent, bool(baggage.get_all(current)))
    return last[1], last[2]


def _resend_counter(span: SpanRecorder, on_resend: Callable[[int], None] | None) -> Callable[[int], None]:
    def count_resend(attempt: int) -> None:
        span.set_attribute(HTTP_REQUEST_RESEND_COUNT, attempt - 1)
        if on_resend is not None:
            on_resend(attempt)

    return count_resend


async def traced_send(
    call: ObservedCall, on_resend: Callable[[int], None] | None = None
) -> aiohttp.ClientResponse:
    """`call.send()` as a CLIENT span whose context goes out in the `traceparent` header; a resent call carries
    `http.request.resend_count` (the number of attempts after the first).

    The span ends when the response headers arrive (the caller reads the body) and covers the resends. It is never
    made the current span: nothing runs under it in this process, and attaching a context costs a few µs. Where
    gym_rpc.client._sdk_spans proves it the same, the SDK's work is done directly (or skipped, for a child of an
    unsampled parent). On a session that aiohttp's OpenTelemetry instrumentation traces, its spans are the CLIENT
    spans (one per attempt) and ours only adds attributes to them (gym_rpc.client._aiohttp_instrumentation).
    """
    kwargs, rollout_id = call.kwargs, current_rollout_id()
    if session_instrumented(call.session):
        return await _send_with_attributes(call, rollout_id, on_resend)
    active, current = tracer(), otel_context.get_current()
    parent, carries_baggage = _inherited(current)
    plan = span_plan(active)
    way = SDK if plan is None else plan.way(parent)
    if way is DROP:
        kwargs["headers"] = trace_context_headers(kwargs.get("headers"), parent, current, carries_baggage)
        return await call.send(on_resend)
    name, static = _static_attributes(call.method, call.base_url, call.server_name)
    attributes = {**static, URL_FULL: call.base_url + call.url_path}
    if rollout_id is not None:
        attributes[ROLLOUT_ID_ATTRIBUTE] = rollout_id
    span: ClientSpan | trace.Span
    if plan is not None and way is DIRECT:
        span = plan.start(name, attributes, parent)
    else:
        span = active.start_span(name, kind=_CLIENT, attributes=attributes)
    try:
        context = span.get_span_context()
        kwargs["headers"] = trace_context_headers(kwargs.get("headers"), context, current, carries_baggage)
        response = await call.send(_resend_counter(span, on_resend))
    except BaseException as error:
        record_failure(span, error)
        raise
    else:
        set_response_status(span, response.status, server=False)
        return response
    finally:
        span.end()


async def _send_with_attributes(
    call: ObservedCall, rollout_id: str | None, on_resend: Callable[[int], None] | None
) -> aiohttp.ClientResponse:
    """`call.send()` on a session aiohttp's instrumentation traces: its span is the CLIENT span, ours adds
    attributes."""
    gym_attributes: dict[str, Any] = {SERVER_NAME_ATTRIBUTE: call.server_name}
    if rollout_id is not None:
        gym_attributes[ROLLOUT_ID_ATTRIBUTE] = rollout_id

    def count_instrumented_resend(attempt: int) -> None:
        gym_attributes[HTTP_REQUEST_RESEND_COUNT] = attempt - 1
        if on_resend is not None:
            on_resend(attempt)

    call.kwargs["trace_request_ctx"] = instrumentation_request_context(gym_attributes)
    return await call.send(count_instrumented_resend)
