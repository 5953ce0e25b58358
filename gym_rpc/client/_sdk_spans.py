"""What the OpenTelemetry SDK's tracer would do with a data-plane call's CLIENT span, where that is provable, so
`traced_send` can do the same for less.

Why: the SDK's `Tracer.start_span` + `Span.end` cost ~16 µs per span (the sampler, attribute validation in
`BoundedAttributes`, a lock, a `Span` and then its `ReadableSpan` copy), and the spans a batching processor holds
until export leave that many more objects for the garbage collector: tracing every call cost a worker half its
throughput. A call's span has a few str/int attributes, maybe an error status, no events and no links, and is
never made current; what the SDK finally hands its processors for it is one `ReadableSpan`. Built directly, it
costs ~3 µs. Two shortcuts, each taken only when it is provably what the SDK would do:

* **A recorded span, built directly** (`DIRECT`, `SpanPlan.start`): the tracer is exactly the SDK's `Tracer`,
  enabled, with its internal metrics off; its sampler would surely record and sample (an always-on sampler, or a
  parent-based one whose delegate for this parent, or for a root, is always-on; such samplers add no attributes
  and keep the parent's trace state); the active processor is the SDK's `SynchronousMultiSpanProcessor` holding
  only exact `BatchSpanProcessor` / `SimpleSpanProcessor` instances, whose `on_start` and `_on_ending` do nothing
  (checked on their code, so an SDK that gives them work turns this off); no span attribute value length limit,
  and an attribute count limit the span stays within (checked at its end). Ids come from the tracer's id
  generator, trace flags and state follow the parent as the SDK's do. A span that must record an exception
  becomes the SDK's own `Span` from then on (same context, start time, attributes and status), so the exception
  event is the SDK's.
* **No span for a child of an unsampled parent** (`DROP`): under a parent-based sampler whose delegate
  for an unsampled parent (local or remote, as the parent is) always drops, the SDK would make a non-recording span
  that nothing sees; the call carries its parent's context instead (the rollout's "sampled once" decision).

Anything else takes the SDK's path, unchanged. The conditions read private SDK attributes (the sampler's
delegates and decision, the processors' tuple, the tracer's limits, config and metrics, `_Span`): this is the only
module that does, every read guarded (an attribute an upgrade moved means "not provable": the SDK's path), and
tests/test_sdk_spans.py fails loudly when one moves, and compares what both paths export field by field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from time import time_ns
from typing import Any

from opentelemetry import trace

_CLIENT = trace.SpanKind.CLIENT
_UNSET = trace.StatusCode.UNSET
_OK = trace.StatusCode.OK
_SAMPLED = trace.TraceFlags(trace.TraceFlags.SAMPLED)
_SAMPLED_RANDOM = trace.TraceFlags(trace.TraceFlags.SAMPLED | trace.TraceFlags.RANDOM_TRACE_ID)
_UNSET_STATUS = trace.Status(_UNSET)
_PlanKey = tuple[Any, ...]
# SpanPlan._facts: (parent, way, trace id, trace flags, trace state, the parent a span records) of a child.
_Facts = tuple[trace.SpanContext | None, str, int | None, trace.TraceFlags | None, Any, trace.SpanContext | None]


SDK, DIRECT, DROP = "sdk", "direct", "drop"  # SpanPlan.way: what a call does about its span


class SpanPlan:
    """What one SDK tracer, in one state, would do with a CLIENT span, by its parent: nothing to prove (`SDK`: its
    own path), a span `start` builds `DIRECT`ly, or no span at all (`DROP`).

    The decision and the parent's ids are remembered for the last parent: a rollout's calls share one."""

    __slots__ = ("_direct_child", "_direct_root", "_dropped_child", "_last", "max_attributes", "readable_span",
                 "sdk_span", "tracer")  # fmt: skip

    def __init__(
        self,
        tracer: Any,
        readable_span: Callable[..., Any],
        sdk_span: Callable[..., Any],
        max_attributes: int | None,
        direct_root: bool,
        direct_child: tuple[tuple[bool, bool], tuple[bool, bool]],
        dropped_unsampled_child: tuple[bool, bool],
    ) -> None:
        self.tracer = tracer
        self.readable_span = readable_span  # opentelemetry.sdk.trace.ReadableSpan
        self.sdk_span = sdk_span  # opentelemetry.sdk.trace._Span: what Tracer.start_span makes
        self.max_attributes = max_attributes
        self._direct_root = direct_root
        self._direct_child = direct_child  # [parent is remote][parent sampled]
        self._dropped_child = dropped_unsampled_child  # [parent is remote], for an unsampled parent
        self._last: _Facts = (None, SDK, None, None, None, None)

    def way(self, parent: trace.SpanContext) -> str:
        """SDK, DIRECT or DROP for a child of `parent` (a root span for an invalid one)."""
        return self._facts(parent)[1]

    def start(self, name: str, attributes: dict[str, Any], parent: trace.SpanContext) -> ClientSpan:
        """The span the SDK would start now (only where `way` is DIRECT), its processors told at its end."""
        _, _, trace_id, flags, state, recorded_parent = self._facts(parent)
        ids = self.tracer.id_generator
        if trace_id is None:  # a root, with the SDK's order of id generator calls
            trace_id = ids.generate_trace_id()
            flags = _SAMPLED_RANDOM if ids.is_trace_id_random() else _SAMPLED
        context = trace.SpanContext(trace_id, ids.generate_span_id(), False, flags, state)
        return ClientSpan(self, name, context, recorded_parent, attributes, time_ns())

    def _facts(self, parent: trace.SpanContext) -> _Facts:
        last = self._last
        if last[0] is parent:
            return last
        if not parent.is_valid:
            last = (parent, DIRECT if self._direct_root else SDK, None, None, None, None)
        else:
            flags, remote = parent.trace_flags, parent.is_remote
            sampled = flags.sampled
            if self._direct_child[remote][sampled]:
                way = DIRECT
            else:
                way = DROP if not sampled and self._dropped_child[remote] else SDK
            child_flags = _SAMPLED_RANDOM if flags.random_trace_id else _SAMPLED
            last = (parent, way, parent.trace_id, child_flags, parent.trace_state, parent)
        self._last = last
        return last


class ClientSpan:
    """A CLIENT span started by `SpanPlan.start`: attributes and status kept as given, one `ReadableSpan` for the
    processors at `end`. Recording an exception (or outgrowing the attribute count limit) turns it into the SDK's
    own span, from then on."""

    __slots__ = ("_attributes", "_context", "_name", "_parent", "_plan", "_sdk", "_start_time", "_status")

    def __init__(
        self,
        plan: SpanPlan,
        name: str,
        context: trace.SpanContext,
        parent: trace.SpanContext | None,
        attributes: dict[str, Any],
        start_time: int,
    ) -> None:
        self._plan, self._name, self._context, self._parent = plan, name, context, parent
        self._attributes, self._start_time = attributes, start_time
        self._status = _UNSET_STATUS
        self._sdk: Any = None

    def get_span_context(self) -> trace.SpanContext:
        return self._context

    def set_attribute(self, key: str, value: str | int) -> None:
        """A str or int value, as the SDK keeps it without a value length limit."""
        if self._sdk is None:
            self._attributes[key] = value
        else:
            self._sdk.set_attribute(key, value)

    def set_status(self, status: trace.Status) -> None:
        """The SDK's rule: an OK status is final, an UNSET one changes nothing."""
        if self._sdk is not None:
            self._sdk.set_status(status)
        elif self._status.status_code is not _OK and status.status_code is not _UNSET:
            self._status = status

    def record_exception(self, exception: BaseException) -> None:
        self._as_sdk_span().record_exception(exception)

    def end(self) -> None:
        plan = self._plan
        if self._sdk is None and plan.max_attributes is not None and len(self._attributes) > plan.max_attributes:
            self._as_sdk_span()  # the SDK decides what it drops
        if self._sdk is not None:
            self._sdk.end()
            return
        tracer = plan.tracer
        span = plan.readable_span(
            name=self._name,
            context=self._context,
            parent=self._parent,
            resource=tracer.resource,
            attributes=self._attributes,
            kind=_CLIENT,
            instrumentation_info=tracer.instrumentation_info,
            status=self._status,
            start_time=self._start_time,
            end_time=time_ns(),
            instrumentation_scope=tracer._instrumentation_scope,
        )
        tracer.span_processor.on_end(span)

    def _as_sdk_span(self) -> Any:
        """The SDK's span this one is (as `Tracer.start_span` makes it), started at its start time."""
        if self._sdk is None:
            tracer = self._plan.tracer
            span = self._plan.sdk_span(
                name=self._name,
                context=self._context,
                parent=self._parent,
                sampler=tracer.sampler,
                resource=tracer.resource,
                attributes=self._attributes,
                span_processor=tracer.span_processor,
                kind=_CLIENT,
                links=(),
                instrumentation_info=tracer.instrumentation_info,
                limits=tracer._span_limits,
                instrumentation_scope=tracer._instrumentation_scope,
            )
            span.start(start_time=self._start_time)
            if self._status.status_code is not _UNSET:
                span.set_status(self._status)
            self._sdk = span
        return self._sdk


def span_plan(tracer: Any) -> SpanPlan | None:
    """The plan for `tracer` as it is now (None: take the SDK's path); re-made whenever its state changes."""
    key = _state_key(tracer)
    cached = _last_plan
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = _plan(tracer) if key is not None else None
    _remember(key, plan)
    return plan


_last_plan: tuple[_PlanKey | None, SpanPlan | None] | None = None


def _remember(key: _PlanKey | None, plan: SpanPlan | None) -> None:
    global _last_plan
    _last_plan = (key, plan)


def _state_key(tracer: Any) -> _PlanKey | None:
    """Everything of the tracer's state a plan depends on (compared by identity and value on every call; an
    application adding a processor or changing a limit gets a new plan). None: not an SDK tracer as known here."""
    try:
        processor = tracer.span_processor
        limits = tracer._span_limits
        config = tracer._tracer_config
        return (
            tracer,
            tracer.sampler,
            processor,
            processor._span_processors,
            limits,
            limits.max_span_attributes,
            limits.max_span_attribute_length,
            config,
            config.is_enabled,
            tracer._tracer_metrics,
        )
    except AttributeError:
        return None


def _plan(tracer: Any) -> SpanPlan | None:
    try:
        from opentelemetry.sdk import trace as sdk_trace
        from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import Decision, ParentBased, StaticSampler
    except ImportError:
        return None
    if type(tracer) is not sdk_trace.Tracer or type(tracer._tracer_metrics) is not NoOpTracerMetrics:
        return None
    sdk_span = getattr(sdk_trace, "_Span", None)
    if not (isinstance(sdk_span, type) and issubclass(sdk_span, sdk_trace.Span)):
        return None

    def decides(sampler: Any, decision: Any) -> bool:
        return (
            type(sampler).should_sample is StaticSampler.should_sample
            and getattr(sampler, "_decision", None) is decision
        )

    def by_parent(decision: Any) -> tuple[bool, tuple[tuple[bool, bool], tuple[bool, bool]]]:
        """(for a root, [remote][sampled] for a child): whether the sampler surely decides `decision`."""
        sampler = tracer.sampler
        if decides(sampler, decision):
            return True, ((True, True), (True, True))
        if type(sampler).should_sample is not ParentBased.should_sample:
            return False, ((False, False), (False, False))
        names = ("_root", "_local_parent_not_sampled", "_local_parent_sampled", "_remote_parent_not_sampled",
                 "_remote_parent_sampled")  # fmt: skip
        root, local_not, local, remote_not, remote = (decides(getattr(sampler, n, None), decision) for n in names)
        return root, ((local_not, local), (remote_not, remote))

    _, ((local_dropped, _), (remote_dropped, _)) = by_parent(Decision.DROP)
    limits = tracer._span_limits
    processors = tracer.span_processor
    direct = (
        tracer._tracer_config.is_enabled
        and limits.max_span_attribute_length is None
        and type(processors) is sdk_trace.SynchronousMultiSpanProcessor
        and all(
            type(p) in (BatchSpanProcessor, SimpleSpanProcessor)
            and _does_nothing(type(p).on_start)
            and _does_nothing(type(p)._on_ending)
            for p in processors._span_processors
        )
    )
    direct_root, direct_child = by_parent(Decision.RECORD_AND_SAMPLE) if direct else (False, ((False,) * 2,) * 2)
    if not (direct_root or any(map(any, direct_child)) or local_dropped or remote_dropped):
        return None
    return SpanPlan(
        tracer=tracer,
        readable_span=sdk_trace.ReadableSpan,
        sdk_span=sdk_span,
        max_attributes=limits.max_span_attributes,
        direct_root=direct_root,
        direct_child=direct_child,
        dropped_unsampled_child=(local_dropped, remote_dropped),
    )


def _pass(*args: Any, **kwargs: Any) -> None:
    pass


@functools.cache
def _does_nothing(function: Any) -> bool:
    """Whether `function`'s body is a bare `pass` (compiled by this interpreter, as ours is)."""
    code, empty = getattr(function, "__code__", None), _pass.__code__
    return code is not None and code.co_code == empty.co_code and code.co_consts == empty.co_consts
