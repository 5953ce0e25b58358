"""A traced data-plane call: `send` as one CLIENT span whose context goes out in the `traceparent` header.

It runs on every call of a traced worker, so it does as little as it can around the SDK's span (measured by the
`tracing` rows of `make bench`): the static attributes of a (method, server) pair are built once; and with the
default propagators (W3C trace context and baggage) and no baggage or trace state to carry, the `traceparent`
value is formatted directly, the very string the propagator writes, without building a context for it. Any other
propagator, baggage or trace state goes through `opentelemetry.propagate` as usual.

Sampling is decided once per rollout: under a parent-based sampler (the SDK's default) a call whose parent span,
e.g. its rollout's (`rollout_context(id, span=True)`), was not sampled could only get an unsampled span, so it
gets none: it carries the parent's context on (unsampled, so the receiving server records nothing either),
paying only for its header and its checks. The rollout's own span is the SDK's either way, so with short
rollouts sampling saves less than its ratio (README, "Tracing": 1 in 10 in rollouts of 8 measures 0.87x).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Coroutine, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict, istr
from opentelemetry import baggage, trace
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from gym_rpc.client._aiohttp_instrumentation import request_context as instrumentation_request_context
from gym_rpc.client._aiohttp_instrumentation import session_instrumented
from gym_rpc.client._http import CallObserver, NextUrl, RetryPolicy, send
from gym_rpc.client._rollout import rollout_id_in_context
from gym_rpc.client._sdk_spans import (
    DIRECT,
    DROP,
    ERROR_STATUS,
    SDK,
    UNSET_STATUS,
    Begun,
    Ending,
    SpanPlan,
    context_getter,
    span_plan,
)
from gym_rpc.telemetry import (
    ERROR_TYPE,
    HTTP_RESPONSE_STATUS_CODE,
    ROLLOUT_ID_ATTRIBUTE,
    SERVER_ADDRESS,
    SERVER_NAME_ATTRIBUTE,
    SERVER_PORT,
    URL_FULL,
    is_error_status,
    method_attributes,
    propagation,
    record_failure,
    set_response_status,
    span_name,
    tracer,
)
from gym_rpc.wire import TRACEPARENT_HEADER

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions

HTTP_REQUEST_RESEND_COUNT = "http.request.resend_count"  # OpenTelemetry http semantic conventions
# A call as its span's attributes know it: method, base URL, server name, URL and rollout id.
_Request = tuple[str, str, str, str, str | None]
# The header name as an istr, as aiohttp's own header names are: its copies take it as it is.
_TRACEPARENT_NAME = istr(TRACEPARENT_HEADER)
_CLIENT = trace.SpanKind.CLIENT


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


def _only_traceparent(textmap: TextMapPropagator, state: Any, carries_baggage: bool) -> bool:
    """Whether what `textmap` writes for a span context with trace state `state` is its `traceparent` alone: the
    default propagator, no trace state, no baggage to carry."""
    return _is_default_propagator(textmap) and (state is DEFAULT_TRACE_STATE or not state) and not carries_baggage


def trace_context_headers(
    given: Any,
    context: trace.SpanContext,
    current: Context | None = None,
    carries_baggage: bool | None = None,
    traceparent: str | None = None,
) -> MutableMapping[str, str]:
    """A copy of the caller's headers (never touched) carrying `context`, ours replacing any traceparent, and the
    baggage of `current` (the current context by default; `carries_baggage` when the caller knows). `traceparent`:
    `context` as the W3C propagator writes it, when the caller has it already."""
    # A CIMultiDict, which aiohttp takes as it is (a dict it copies into one first).
    headers: MutableMapping[str, str] = CIMultiDict(given) if given else CIMultiDict()
    propagate = propagation()
    if carries_baggage is None:
        carries_baggage = bool(baggage.get_all(current))
    if _only_traceparent(propagate.get_global_textmap(), context.trace_state, carries_baggage):
        if traceparent is None:
            ids = (context.trace_id, context.span_id, context.trace_flags)
            traceparent = "00-%032x-%016x-%02x" % ids  # noqa: UP031 (here faster than an f-string)
        headers[_TRACEPARENT_NAME] = traceparent
    else:
        carried = trace.set_span_in_context(trace.NonRecordingSpan(context), current)
        propagate.inject(headers, context=carried)
    return headers


# _route's answer for one context: (the context, weakly; the plan; the global propagator; the parent; whether the
# context carries baggage; the way; whether the headers need only a traceparent; the parent's own traceparent, for
# a call that carries it on unsampled; "" for others).
_Route = tuple[
    Callable[[], Context | None], SpanPlan | None, TextMapPropagator | None, trace.SpanContext, bool, str, bool,
    str,
]  # fmt: skip
_last_route: _Route = (lambda: None, None, None, trace.INVALID_SPAN_CONTEXT, False, SDK, False, "")
_routes: dict[int, _Route] = {}
_current_context = context_getter()  # opentelemetry.context.get_current, in one call
REMEMBERED_CONTEXTS = 4096  # contexts whose routes are kept (then they start afresh)


def _global_textmap() -> TextMapPropagator:
    """opentelemetry.propagate.get_global_textmap, bound on the first traced call (importing it loads the
    configured propagators)."""
    global _global_textmap
    _global_textmap = propagation().get_global_textmap
    return _global_textmap()


def _route(current: Context, plan: SpanPlan | None, textmap: TextMapPropagator) -> _Route:
    """A call's parent (the current span's context), whether `current` carries baggage, what `plan` does with a
    child of that parent (SDK, DIRECT or DROP), and whether a child's headers are only its traceparent (the
    default propagators, no baggage, no trace state). Contexts are immutable and a rollout's calls share one, so
    the answer is remembered per context (weakly: it is not kept alive) for at most REMEMBERED_CONTEXTS at once,
    and the last one is checked first by the caller."""
    global _last_route
    route = _routes.get(id(current))
    if route is None or route[0]() is not current or route[1] is not plan or route[2] is not textmap:
        parent = trace.get_current_span(current).get_span_context()
        way = SDK if plan is None else plan.way(parent)
        carried = ""
        if way is DROP:
            carried = "00-%032x-%016x-%02x" % (parent.trace_id, parent.span_id, parent.trace_flags)  # noqa: UP031
        carries_baggage = bool(baggage.get_all(current))
        plain = _only_traceparent(textmap, parent.trace_state, carries_baggage)  # a direct child keeps its state
        route = (weakref.ref(current), plan, textmap, parent, carries_baggage, way, plain, carried)
        if len(_routes) >= REMEMBERED_CONTEXTS:
            _routes.clear()
        _routes[id(current)] = route
    _last_route = route
    return route


def traced_send(
    session: aiohttp.ClientSession,
    method: str,
    base_url: str,
    url: str,
    retry: RetryPolicy,
    resend_after_disconnect: bool,
    kwargs: _RequestOptions,
    server_name: str,
    also: CallObserver | None = None,
    *,
    next_url: NextUrl | None = None,
) -> Coroutine[Any, Any, aiohttp.ClientResponse]:
    """`send(session, method, url, ...)` (`url` under `base_url`, the server's) as a CLIENT span whose context
    goes out in the `traceparent` header; a resent call carries `http.request.resend_count` (the number of
    attempts after the first). `also` (the worker metrics') is told what the span is, each resend, the answer or
    the error, and before it: whatever the span's work raises, the call has been counted.

    The span ends when the response headers arrive (the caller reads the body) and covers the resends. It is never
    made the current span: nothing runs under it in this process, and attaching a context costs a few µs. Where
    gym_rpc.client._sdk_spans proves it the same, the SDK's work is done directly (or skipped, for a child of an
    unsampled parent). On a session that aiohttp's OpenTelemetry instrumentation traces, its spans are the CLIENT
    spans (one per attempt) and ours only adds attributes to them (gym_rpc.client._aiohttp_instrumentation).

    It returns `send`'s own coroutine, the span told of the outcome from inside it (a CallObserver): a coroutine of
    ours between the caller and aiohttp would cost every resumption of the call. The span starts here, so the
    coroutine must be awaited at once (as ServerClient.request and metered_send do): one never awaited would
    leave its span unended. Every traced call runs this between aiohttp's own work, where each line costs several
    times what it costs in a loop of its own (cold caches), so the direct path takes as few calls as it can: the
    call comes as parameters, not as an object, and its span's start and observer are one tuple.
    """
    rollout_id = rollout_id_in_context()
    if getattr(session, "_trace_configs", True) and session_instrumented(session):  # aiohttp's list, else ask
        instrumented = _InstrumentedCall(kwargs, server_name, rollout_id, also)
        return send(
            session,
            method,
            url,
            retry,
            resend_after_disconnect,
            kwargs,
            instrumented,
            server_name=server_name,
            next_url=next_url,
        )
    active, current, textmap = tracer(), _current_context(), _global_textmap()
    plan = span_plan(active)
    route = _last_route
    if route[0]() is not current or route[1] is not plan or route[2] is not textmap:
        route = _route(current, plan, textmap)
    _, _, _, parent, carries_baggage, way, plain, carried = route
    given = kwargs.get("headers")
    observer: CallObserver | None
    if way is DIRECT:
        assert plan is not None
        request = (method, base_url, server_name, url, rollout_id)
        observer = begun = plan.begin(parent, _DirectCall, request, also)
        context, traceparent = begun.context, begun.traceparent
    elif way is DROP:  # the parent's context carried on
        observer = also
        context, traceparent = parent, carried
    else:
        attributes = _call_attributes(method, base_url, server_name, url, rollout_id)
        span = active.start_span(span_name(method), kind=_CLIENT, attributes=attributes)
        try:
            kwargs["headers"] = trace_context_headers(given, span.get_span_context(), current, carries_baggage)
        except BaseException:
            span.end()
            raise
        return send(
            session,
            method,
            url,
            retry,
            resend_after_disconnect,
            kwargs,
            _SdkCall(span, also),
            server_name=server_name,
            next_url=next_url,
        )
    if plain:  # trace_context_headers, inline
        headers: MutableMapping[str, str] = CIMultiDict(given) if given else CIMultiDict()
        headers[_TRACEPARENT_NAME] = traceparent
    else:
        headers = trace_context_headers(given, context, current, carries_baggage, traceparent)
    kwargs["headers"] = headers
    return send(
        session,
        method,
        url,
        retry,
        resend_after_disconnect,
        kwargs,
        observer,
        server_name=server_name,
        next_url=next_url,
    )


class _DirectCall(Begun):
    """The CallObserver of a call whose span `SpanPlan.begin` started (its `request` is the call as its span's
    attributes know it): at the answer, `finish`ed directly (with the attributes a rollout's calls share, unless it
    was resent); at an error, made the SDK's own span to record it, so the exception event is the SDK's. `also`
    is told first."""

    __slots__ = ()

    def resent(self, attempt: int, kind: str) -> None:
        also = self.also
        if also is not None:
            also.resent(attempt, kind)

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        request, also = self.request, self.also
        if also is not None:
            also.answered(response, attempts)
        if attempts == 1:
            self.plan.finish(_finished(request, response.status), self)
            return
        attributes = _attributes_after(request, attempts)
        self.plan.finish((span_name(request[0]), attributes, _answered(attributes, response.status)), self)

    def failed(self, error: BaseException, attempts: int) -> None:
        request, also = self.request, self.also
        if also is not None:
            also.failed(error, attempts)
        span = self.plan.sdk_span(span_name(request[0]), _attributes_after(request, attempts), UNSET_STATUS, self)
        record_failure(span, error)
        span.end()


def _attributes_after(request: _Request, attempts: int) -> dict[str, Any]:
    """A call's own attributes after `attempts` attempts, in the order the SDK's span would have them."""
    attributes = _call_attributes(*request)
    if attempts > 1:
        attributes[HTTP_REQUEST_RESEND_COUNT] = attempts - 1
    return attributes


class _SdkCall:
    """The CallObserver of a call in the SDK's own span (`also` told first)."""

    __slots__ = ("also", "span")

    def __init__(self, span: trace.Span, also: CallObserver | None) -> None:
        self.span, self.also = span, also

    def resent(self, attempt: int, kind: str) -> None:
        if self.also is not None:
            self.also.resent(attempt, kind)
        self.span.set_attribute(HTTP_REQUEST_RESEND_COUNT, attempt - 1)

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        if self.also is not None:
            self.also.answered(response, attempts)
        set_response_status(self.span, response.status, server=False)
        self.span.end()

    def failed(self, error: BaseException, attempts: int) -> None:
        if self.also is not None:
            self.also.failed(error, attempts)
        record_failure(self.span, error)
        self.span.end()


def _call_attributes(
    method: str, base_url: str, server_name: str, url: str, rollout_id: str | None
) -> dict[str, Any]:
    """A call's span attributes before its answer: the server's, the URL and the rollout id."""
    attributes = {**_static_attributes(method, base_url, server_name), URL_FULL: url}
    if rollout_id is not None:
        attributes[ROLLOUT_ID_ATTRIBUTE] = rollout_id
    return attributes


def _answered(attributes: dict[str, Any], status: int) -> trace.Status:
    """set_response_status for a direct client span: the answer's status code (and error.type) in `attributes`,
    and the span's status."""
    attributes[HTTP_RESPONSE_STATUS_CODE] = status
    if is_error_status(status, server=False):
        attributes[ERROR_TYPE] = str(status)
        return ERROR_STATUS
    return UNSET_STATUS


@functools.lru_cache(maxsize=4096)
def _finished(request: _Request, status: int) -> Ending:
    """The span name, attributes and status of a direct span answered with `status` at the first attempt, shared
    by every such call (mostly a rollout's calls to one server): a span holds them read-only until its export,
    so calls that share them leave the batching processor one dict to hold, not one each."""
    attributes = _call_attributes(*request)
    return span_name(request[0]), attributes, _answered(attributes, status)


class _InstrumentedCall:
    """The CallObserver of a call on a session aiohttp's instrumentation traces: its span is the CLIENT span, and
    ours adds attributes to it (through the call's `trace_request_ctx`), the resend count among them; `also` is
    told everything, first."""

    __slots__ = ("also", "gym_attributes")

    def __init__(
        self, kwargs: _RequestOptions, server_name: str, rollout_id: str | None, also: CallObserver | None
    ) -> None:
        gym_attributes: dict[str, Any] = {SERVER_NAME_ATTRIBUTE: server_name}
        if rollout_id is not None:
            gym_attributes[ROLLOUT_ID_ATTRIBUTE] = rollout_id
        kwargs["trace_request_ctx"] = instrumentation_request_context(gym_attributes)
        self.gym_attributes, self.also = gym_attributes, also

    def resent(self, attempt: int, kind: str) -> None:
        if self.also is not None:
            self.also.resent(attempt, kind)
        self.gym_attributes[HTTP_REQUEST_RESEND_COUNT] = attempt - 1

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        if self.also is not None:
            self.also.answered(response, attempts)

    def failed(self, error: BaseException, attempts: int) -> None:
        if self.also is not None:
            self.also.failed(error, attempts)
