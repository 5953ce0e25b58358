"""A traced data-plane call: `send` as one CLIENT span, made on OpenTelemetry's public API, whose context goes out
in the `traceparent` header.

* **One span per call**, `tracer.start_span` with the attributes a (method, server) pair shares built once; ended
  when the response headers arrive (the caller reads the body), covering the resends. It is never made the
  current span: nothing runs under it in this process.
* **No span for a child of an unsampled parent** (gym_rpc's policy, whatever the sampler): when the current span
  (a rollout's `gym.rollout`, the caller's own) is valid and its trace flags say "not sampled", the call makes no
  span and carries that parent's context on, unsampled, so the receiving server records nothing either. Under a
  parent-based sampler (the SDK's default, and the `ParentBased(TraceIdRatioBased(r))` the README recommends)
  this is the SDK's own decision, made for less. So a trace is sampled once, at its root.
* **Propagation**: the global propagator's `inject`; or, when that propagator is OpenTelemetry's default (see
  `is_default_propagator`) and the context carries no baggage and no trace state, the one `traceparent` header it
  would write, formatted directly.
* **Tracing never fails the call**: what the tracer, the sampler or a span processor raises when the span starts
  is logged (gym_rpc.telemetry.instrumentation_failed) and the call goes on untraced; at its end `send` does the
  same for its observer.
* **With aiohttp's instrumentation** on the session (gym_rpc.client.tracing._aiohttp_instrumentation), its spans
  are the CLIENT spans (one per attempt) and ours only adds attributes to them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVarTuple
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy, istr
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator

from gym_rpc.client.data._call_metrics import metered_call
from gym_rpc.client.data._http import Call
from gym_rpc.client.resend import CallObserver
from gym_rpc.client.tracing import known_headers, remember_headers, session_instrumented
from gym_rpc.client.tracing import request_context as instrumentation_request_context
from gym_rpc.metrics import METRICS
from gym_rpc.telemetry import (
    ROLLOUT_ID_ATTRIBUTE,
    SERVER_ADDRESS,
    SERVER_NAME_ATTRIBUTE,
    SERVER_PORT,
    URL_FULL,
    instrumentation_failed,
    method_attributes,
    propagation,
    record_failure,
    set_response_status,
    span_name,
    tracer,
)
from gym_rpc.telemetry import TRACING as TRACES  # the switch (TRACING below: the kind its failures log under)
from gym_rpc.wire import TRACEPARENT_HEADER

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions

HTTP_REQUEST_RESEND_COUNT = "http.request.resend_count"  # OpenTelemetry http semantic conventions
TRACING = "tracing"  # the kind instrumentation_failed logs these failures under
# The header name as an istr, as aiohttp's own header names are: its copies take it as it is.
_TRACEPARENT_NAME = istr(TRACEPARENT_HEADER)
_CLIENT = trace.SpanKind.CLIENT
# What OpenTelemetry's default propagator (W3C trace context, then W3C baggage) writes, by its public `fields`.
_W3C_FIELDS = (frozenset({"traceparent", "tracestate", "baggage"}), frozenset({"traceparent", "tracestate"}))


@functools.lru_cache(maxsize=1024)
def _static_attributes(method: str, base_url: str, server_name: str) -> Mapping[str, Any]:
    """The attributes every call of `method` to `server_name` at `base_url` shares (shared: callers copy them)."""
    parts = urlsplit(base_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return {
        **method_attributes(method),
        SERVER_ADDRESS: parts.hostname or "",
        SERVER_PORT: port,
        SERVER_NAME_ATTRIBUTE: server_name,
    }


# The global propagator gym_rpc's first traced call saw, and whether it is OpenTelemetry's default.
_first_textmap: TextMapPropagator | None = None
_first_is_default = False


def is_default_propagator(textmap: TextMapPropagator) -> bool:
    """Whether `textmap`, the global propagator now, is OpenTelemetry's default, decided on public facts only: it
    is the propagator the first traced call saw (what `opentelemetry.propagate` made from `OTEL_PROPAGATORS`,
    unless the application set its own before), and that one is a `CompositePropagator` whose `fields` are W3C
    trace context's (and W3C baggage's). A propagator set later with `set_global_textmap` is never taken for the
    default: every call goes through its `inject`."""
    global _first_textmap, _first_is_default
    if _first_textmap is None:
        _first_textmap = textmap
        _first_is_default = type(textmap) is CompositePropagator and textmap.fields in _W3C_FIELDS
    return textmap is _first_textmap and _first_is_default


def trace_context_headers(
    given: Any,
    span_context: trace.SpanContext,
    current: Context | None = None,
    textmap: TextMapPropagator | None = None,
) -> CIMultiDict[str]:
    """A copy of the caller's headers (their mapping is never touched) carrying `span_context` and the baggage of
    `current` (the current context by default), as `textmap` (the global propagator by default) writes them: ours
    replace any traceparent of theirs. With the default propagator, no baggage and no trace state, that is one
    header, formatted here."""
    # A CIMultiDict, which aiohttp takes as it is (a dict it copies into one first).
    headers: CIMultiDict[str] = CIMultiDict(given) if given else CIMultiDict()
    if current is None:
        current = otel_context.get_current()
    if textmap is None:
        textmap = propagation().get_global_textmap()
    if is_default_propagator(textmap) and not span_context.trace_state and not baggage.get_all(current):
        ids = (span_context.trace_id, span_context.span_id, span_context.trace_flags)
        headers[_TRACEPARENT_NAME] = "00-%032x-%016x-%02x" % ids  # noqa: UP031 (here faster than an f-string)
    else:
        carried = trace.set_span_in_context(trace.NonRecordingSpan(span_context), current)
        textmap.inject(headers, context=carried)
    return headers


def observer_for(call: Call, base_url: str) -> CallObserver | None:
    """`call`'s observer, chosen here alone (to be sent at once: it is counted in flight and its span started
    here): the worker metrics' (while `METRICS.enabled`), then its span (while `TRACING.enabled`), both told from
    inside `send`; None when neither observes it. `base_url` is the server's (or its instance's), for the span.
    A replicated server's route is told by its routed send (gym_rpc.client.data._routed_send), after them."""
    metered = metered_call(call.server, call.method) if METRICS.enabled else None
    span = call_span(call, base_url) if TRACES.enabled else None
    if span is None:
        return metered
    return span if metered is None else ObserverPair(metered, span)


def call_span(call: Call, base_url: str) -> CallObserver | None:
    """The observer of a traced call (to `call.url`, under `base_url`, the server's): its CLIENT span, started,
    whose context goes out in the `traceparent` header (put in `call.kwargs`); a resent call carries
    `http.request.resend_count` (the number of attempts after the first). None for a call that records no span: it
    is sent as an untraced call is, with no observer. That is a child of an unsampled parent, which carries that
    parent's context on (in headers made once per context when the caller gave none:
    gym_rpc.client.tracing._unsampled_headers), a root the sampler dropped, or tracing that failed. The span starts
    here, so the call must be sent at once. It never raises: tracing that fails leaves the call untraced, and
    logged.

    One function, not two, because most calls under sampling take its first return: a rollout's later calls."""
    kwargs = call.kwargs
    if session_instrumented(call.session):
        return _InstrumentedCall(kwargs, call.server, call.rollout)
    span: trace.Span | None = None
    try:
        current = otel_context.get_current()
        given = kwargs.get("headers")
        textmap = propagation().get_global_textmap()
        if not given and (known := known_headers(current, textmap)) is not None:
            kwargs["headers"] = known  # a later call of a rollout the sampler dropped: most calls, sampling
            return None
        parent = trace.get_current_span(current).get_span_context()
        if parent.is_valid and not parent.trace_flags.sampled:
            headers = trace_context_headers(given, parent, current, textmap)
            kwargs["headers"] = headers if given else remember_headers(current, textmap, CIMultiDictProxy(headers))
            return None
        method = call.method
        attributes = {**_static_attributes(method, base_url, call.server), URL_FULL: call.url}
        if call.rollout is not None:
            attributes[ROLLOUT_ID_ATTRIBUTE] = call.rollout
        span = tracer().start_span(span_name(method), context=current, kind=_CLIENT, attributes=attributes)
        kwargs["headers"] = trace_context_headers(given, span.get_span_context(), current, textmap)
        if span.is_recording():
            return _CallSpan(span)
    except Exception as error:
        instrumentation_failed(TRACING, error)
        _end_quietly(span)
    return None


def _end_quietly(span: trace.Span | None) -> None:
    """End a span whose call goes on untraced; what that raises is logged."""
    if span is None:
        return
    try:
        span.end()
    except Exception as error:
        instrumentation_failed(TRACING, error)


_Event = TypeVarTuple("_Event")  # what a CallObserver method is told


class ObserverPair:
    """Two observers of one call (the worker metrics, then the call's span), each told everything, in order:
    what the first raises is logged and the second is told all the same (what the second raises, `send` logs)."""

    __slots__ = ("first", "kind", "second")

    def __init__(self, first: CallObserver, second: CallObserver) -> None:
        self.first, self.second, self.kind = first, second, second.kind

    def resent(self, attempt: int, kind: str) -> None:
        self._tell_first(self.first.resent, attempt, kind)
        self.second.resent(attempt, kind)

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        self._tell_first(self.first.answered, response, attempts)
        self.second.answered(response, attempts)

    def failed(self, error: BaseException, attempts: int) -> None:
        self._tell_first(self.first.failed, error, attempts)
        self.second.failed(error, attempts)

    def _tell_first(self, tell: Callable[[*_Event], None], *event: *_Event) -> None:
        """The first observer told of `event`; what it raises is logged, so the second is told all the same."""
        try:
            tell(*event)
        except Exception as error:
            instrumentation_failed(self.first.kind, error)


class _CallSpan:
    """The CallObserver of a call's own span: its resend count, then its answer or error, and its end."""

    __slots__ = ("span",)
    kind = TRACING

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def resent(self, attempt: int, kind: str) -> None:
        self.span.set_attribute(HTTP_REQUEST_RESEND_COUNT, attempt - 1)

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        try:
            set_response_status(self.span, response.status, server=False)
        finally:
            self.span.end()

    def failed(self, error: BaseException, attempts: int) -> None:
        try:
            record_failure(self.span, error)
        finally:
            self.span.end()


class _InstrumentedCall:
    """The CallObserver of a call on a session aiohttp's instrumentation traces: its span is the CLIENT span, and
    ours adds attributes to it (through the call's `trace_request_ctx`), the resend count among them."""

    __slots__ = ("gym_attributes",)
    kind = TRACING

    def __init__(self, kwargs: _RequestOptions, server_name: str, rollout_id: str | None) -> None:
        gym_attributes: dict[str, Any] = {SERVER_NAME_ATTRIBUTE: server_name}
        if rollout_id is not None:
            gym_attributes[ROLLOUT_ID_ATTRIBUTE] = rollout_id
        kwargs["trace_request_ctx"] = instrumentation_request_context(gym_attributes)
        self.gym_attributes = gym_attributes

    def resent(self, attempt: int, kind: str) -> None:
        self.gym_attributes[HTTP_REQUEST_RESEND_COUNT] = attempt - 1

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        pass

    def failed(self, error: BaseException, attempts: int) -> None:
        pass
