"""The rollout a call belongs to, and root URLs that carry it (the path format itself is `gym_rpc.wire`'s).

The rollout id lives in a context variable so every call made for a rollout (in any task spawned under it) carries
it without threading it through arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from gym_rpc.client.tracing import forget_headers
from gym_rpc.telemetry import ROLLOUT_ID_ATTRIBUTE, TRACING, instrumentation_failed, tracer
from gym_rpc.wire import TRACEPARENT_HEADER, encode_rollout_id, rollout_path_prefix, trace_path_segment

if TYPE_CHECKING:
    from opentelemetry import trace

_rollout_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("gym_rpc_rollout_id", default=None)


def current_rollout_id() -> str | None:
    """The rollout id bound in this context, if any."""
    return _rollout_id.get()


# current_rollout_id without a Python call of its own, for the data plane's hot paths (each call is one).
rollout_id_in_context = _rollout_id.get


ROLLOUT_SPAN_NAME = "gym.rollout"


@contextlib.contextmanager
def rollout_context(rollout_id: str | None, *, span: bool = False) -> Iterator[str | None]:
    """Bind a rollout id for the calls made inside the block (and the tasks it starts); "" means no rollout.

    `span=True` (while tracing is on) also opens one `gym.rollout` span around the block, the parent of every call
    made inside: a rollout's model calls and its `/verify` land in one trace, sampled (or not) once for all of
    them. Without it each call's span is a root of its own unless the caller has a span current.
    """
    if rollout_id:
        encode_rollout_id(rollout_id)  # fail where the id is bound, not at the first call
    token = _rollout_id.set(rollout_id)
    try:
        if not (span and TRACING.enabled):
            yield rollout_id
            return
        # tracer().start_as_current_span(...) as the API's use_span runs it (the span current inside; an Exception
        # leaving the block recorded and made its error status; ended once the context is restored), without its
        # two context managers of its own: a worker opens one per rollout, and a rollout can be a few calls. What
        # the tracer raises (a sampler, a span processor) is logged, never the block's: it runs untraced.
        rollout_span = _started_rollout_span(rollout_id)
        if rollout_span is None:
            yield rollout_id
            return
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        rollout_span_context = trace.set_span_in_context(rollout_span)
        attached = otel_context.attach(rollout_span_context)
        try:
            yield rollout_id
        except Exception as error:
            if rollout_span.is_recording():
                rollout_span.record_exception(error)
                rollout_span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            raise
        finally:
            otel_context.detach(attached)
            forget_headers(rollout_span_context)
            try:
                rollout_span.end()
            except Exception as error:
                instrumentation_failed("tracing", error)
    finally:
        _rollout_id.reset(token)


def _started_rollout_span(rollout_id: str | None) -> trace.Span | None:
    """The rollout's `gym.rollout` span, started; None (and the failure logged) when the tracer raises."""
    attributes = {ROLLOUT_ID_ATTRIBUTE: rollout_id} if rollout_id else {}
    try:
        return tracer().start_span(ROLLOUT_SPAN_NAME, attributes=attributes)
    except Exception as error:
        instrumentation_failed("tracing", error)
        return None


def trace_context_path_segment() -> str:
    """Return `/ng-trace/<traceparent>` for the current span, or "" while traces are off or no span is current.

    "While traces export" means while the current span's trace is exported: the segment is there whenever the
    current span is valid and sampled, whoever started it (gym_rpc's `gym.rollout`, or a span the application
    started under its own TracerProvider, gym_rpc's own tracing on or off). A valid span that is not sampled gives
    it only while gym_rpc traces (gym_rpc.telemetry), carrying its "not sampled" on, as gym_rpc's calls do."""
    context = _exported_span_context()
    if context is None:
        return ""
    return trace_path_segment(context.trace_id, context.span_id, context.trace_flags)


def _exported_span_context() -> trace.SpanContext | None:
    """The current span's context while its trace exports (see `trace_context_path_segment`), else None."""
    trace_api = sys.modules.get("opentelemetry.trace")
    if trace_api is None:  # OpenTelemetry's API is not even loaded: no span was made, none is current
        return None
    context: trace.SpanContext = trace_api.get_current_span().get_span_context()
    if not context.is_valid or not (context.trace_flags.sampled or TRACING.enabled):
        return None
    return context


def apply_rollout_prefix(
    base_url: str, rollout_id: str | None, token_capture: bool = False, trace_context: bool = True
) -> str:
    """Append the rollout prefix and, while traces export, the current span's trace context to a root URL.

    For URLs handed to clients Gym does not instrument. Pass trace_context=False for a URL built once and reused
    across rollouts, or every later rollout would be parented to the first one's span.
    """
    prefix = rollout_path_prefix(rollout_id, token_capture)
    if trace_context:
        prefix += trace_context_path_segment()
    return base_url.rstrip("/") + prefix if prefix else base_url  # nothing to add: the URL as given


def rollout_headers(rollout_id: str | None, session_header: str, trace_context: bool = True) -> dict[str, str]:
    """The header form of `apply_rollout_prefix`, for a server that takes the session key in `session_header` (an
    engine or router: its entry's `session_affinity_header`): the rollout id there and, while traces export, the
    current span's context in `traceparent`, where the path form puts `/ng-rollout/<id>` and `/ng-trace/<tp>`."""
    headers: dict[str, str] = {}
    if rollout_id:
        headers[session_header] = encode_rollout_id(rollout_id)
    if trace_context and (context := _exported_span_context()) is not None:
        ids = (context.trace_id, context.span_id, context.trace_flags)
        headers[TRACEPARENT_HEADER] = "00-%032x-%016x-%02x" % ids  # noqa: UP031 (the W3C format, as on the path)
    return headers


class RolloutTarget(NamedTuple):
    """Where a client Gym does not instrument (an OpenAI client, a harness) sends a rollout's calls to one server:
    `url` to use as its base URL and `headers` to send with every call (its default headers)."""

    url: str
    headers: dict[str, str]
