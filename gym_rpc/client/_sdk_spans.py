"""What the OpenTelemetry SDK's tracer would do with a data-plane call's CLIENT span, where that is provable, so
`traced_send` can do the same for less.

Why: the SDK's `Tracer.start_span` + `Span.end` cost ~16 µs per span (the sampler, attribute validation in
`BoundedAttributes`, a lock, a `Span` and then its `ReadableSpan` copy), and the spans a batching processor holds
until export leave that many more objects for the garbage collector: tracing every call cost a worker half its
throughput. A call's span has a few str/int attributes, maybe an error status, no events and no links, and is
never made current; what the SDK finally hands its processors for it is one `ReadableSpan`. Built directly, it
costs ~2.5 µs. Two shortcuts, each taken only when it is provably what the SDK would do:

* **A recorded span, built directly** (`DIRECT`, `SpanPlan.begin` then `finish`): the tracer is exactly the
  SDK's `Tracer`, enabled, with its internal metrics off; its sampler would surely record and sample (an
  always-on sampler, or a parent-based one whose delegate for this parent, or for a root, is always-on; such
  samplers add no attributes and keep the parent's trace state); the active processor is the SDK's
  `SynchronousMultiSpanProcessor` holding only exact `BatchSpanProcessor` / `SimpleSpanProcessor` instances,
  whose `on_start` and `_on_ending` do nothing (checked on their code, so an SDK that gives them work turns this
  off); no span attribute value length limit, and an attribute count limit the span stays within (checked at
  its end). Ids come from the tracer's id generator (the SDK's random one's rule inline), trace flags and state
  follow the parent as the SDK's do, and the finished span goes to each processor's `on_end` as the
  multi-processor's loop would hand it. A span that must record an exception is made the SDK's own `Span` (same
  context, start time, attributes and status), so the exception event is the SDK's.
* **No span for a child of an unsampled parent** (`DROP`): under a parent-based sampler whose delegate
  for an unsampled parent (local or remote, as the parent is) always drops, the SDK would make a non-recording span
  that nothing sees; the call carries its parent's context instead (the rollout's "sampled once" decision).

Anything else takes the SDK's path, unchanged. The conditions read private SDK attributes (the sampler's
delegates and decision, the processors' tuple, the tracer's limits, config and metrics, `_Span`; and the API's
runtime context, for `context_getter`): this is the only module that does, every read guarded (an attribute an
upgrade moved means "not provable": the SDK's path), and tests/test_sdk_spans.py fails loudly when one moves, and
compares what both paths export field by field.
"""

from __future__ import annotations

import contextvars
import functools
import random
from collections.abc import Callable, Mapping
from time import time_ns
from typing import Any, NamedTuple, TypeVar

from opentelemetry import trace
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

_CLIENT = trace.SpanKind.CLIENT
_UNSET = trace.StatusCode.UNSET
_SAMPLED = trace.TraceFlags(trace.TraceFlags.SAMPLED)
_SAMPLED_RANDOM = trace.TraceFlags(trace.TraceFlags.SAMPLED | trace.TraceFlags.RANDOM_TRACE_ID)
UNSET_STATUS = trace.Status(_UNSET)
ERROR_STATUS = trace.Status(trace.StatusCode.ERROR)
_PlanKey = tuple[Any, ...]
# SpanPlan._facts: (parent, way, trace id, trace flags, trace state, the parent a span records, and the parts of a
# child's traceparent before and after its span id) of a child.
_Facts = tuple[
    trace.SpanContext | None, str, int | None, trace.TraceFlags | None, Any, trace.SpanContext | None, str, str
]
_NEW_TUPLE = tuple.__new__
_SPAN_CONTEXT = trace.SpanContext
Ending = tuple[str, Mapping[str, Any], trace.Status]  # a span's name, attributes and status at its end


class Begun(NamedTuple):
    """What `SpanPlan.begin` started: a direct span's context, the parent it records, its traceparent header, its
    start time and its plan; and what the caller carries with it to the span's end (`request`, `also`),
    so that a call makes one tuple for its span, not two. Made as a plain tuple: no Python call."""

    context: trace.SpanContext
    parent: trace.SpanContext | None
    traceparent: str
    start_time: int
    plan: SpanPlan
    request: Any
    also: Any


BegunType = TypeVar("BegunType", bound=Begun)


SDK, DIRECT, DROP = "sdk", "direct", "drop"  # SpanPlan.way: what a call does about its span
REMEMBERED_PARENTS = 4096  # parents whose children's facts a plan keeps (then it starts afresh)


class SpanPlan:
    """What one SDK tracer, in one state, would do with a CLIENT span, by its parent: nothing to prove (`SDK`: its
    own path), a span built `DIRECT`ly (`begin`, then `finish` or `sdk_span`), or no span at all (`DROP`).

    The decision and the parent's ids are remembered per parent: a rollout's calls share one. A direct
    span is no object of its own until it ends: `begin` gives its context, `finish` hands the processors the one
    `ReadableSpan` the SDK would, so a call makes one span object, not three."""

    __slots__ = ("_by_parent", "_direct_child", "_direct_root", "_dropped_child", "_last", "_random_ids",
                 "batch_on_end", "max_attributes", "readable_span", "sdk_span_type", "tracer")  # fmt: skip

    def __init__(
        self,
        tracer: Any,
        readable_span: Callable[..., Any],
        sdk_span_type: Callable[..., Any],
        max_attributes: int | None,
        direct_root: bool,
        direct_child: tuple[tuple[bool, bool], tuple[bool, bool]],
        dropped_unsampled_child: tuple[bool, bool],
        batch_on_end: Callable[..., None] | None = None,
    ) -> None:
        self.tracer = tracer
        self.batch_on_end = batch_on_end  # BatchSpanProcessor.on_end when its code is the one known here
        self.readable_span = readable_span  # opentelemetry.sdk.trace.ReadableSpan
        self.sdk_span_type = sdk_span_type  # opentelemetry.sdk.trace._Span: what Tracer.start_span makes
        self.max_attributes = max_attributes
        self._direct_root = direct_root
        self._direct_child = direct_child  # [parent is remote][parent sampled]
        self._dropped_child = dropped_unsampled_child  # [parent is remote], for an unsampled parent
        self._random_ids = _is_random_id_generator(tracer.id_generator)
        self._last: _Facts = (None, SDK, None, None, None, None, "", "")
        self._by_parent: dict[int, _Facts] = {}

    def way(self, parent: trace.SpanContext) -> str:
        """SDK, DIRECT or DROP for a child of `parent` (a root span for an invalid one)."""
        last = self._last
        return (last if last[0] is parent else self._facts(parent))[1]

    def begin(self, parent: trace.SpanContext, made_as: type[BegunType], request: Any, also: Any) -> BegunType:
        """A span the SDK would start now (only where `way` is DIRECT), as a `made_as` (a Begun): its context, the
        parent it records, its `traceparent` as the W3C propagator writes it, its start time, and the caller's
        `request` and `also`."""
        last = self._last
        if last[0] is not parent:
            last = self._facts(parent)
        _, _, trace_id, flags, state, recorded_parent, head, tail = last
        if trace_id is None:  # a root, with the SDK's order of id generator calls
            ids = self.tracer.id_generator
            trace_id = ids.generate_trace_id()
            flags = _SAMPLED_RANDOM if ids.is_trace_id_random() else _SAMPLED
            state = DEFAULT_TRACE_STATE  # SpanContext's for None
            head, tail = "00-%032x-" % trace_id, "-%02x" % flags  # noqa: UP031 (faster than f-strings here)
        if self._random_ids:  # RandomIdGenerator.generate_span_id, inline
            span_id = random.getrandbits(64)
            while span_id == 0:
                span_id = random.getrandbits(64)
        else:
            span_id = self.tracer.id_generator.generate_span_id()
        # The tuple SpanContext(trace_id, span_id, False, flags, state) makes, without its checks: both ids are
        # valid (the parent's, or the generator's), so is_valid is True.
        context = _NEW_TUPLE(_SPAN_CONTEXT, (trace_id, span_id, False, flags, state, True))
        traceparent = head + span_id.to_bytes(8, "big").hex() + tail  # "%016x" % span_id, for less
        return _NEW_TUPLE(made_as, (context, recorded_parent, traceparent, time_ns(), self, request, also))

    def finish(self, ending: Ending, begun: Begun) -> None:
        """End a span `begin` started with its name, attributes and status: the `ReadableSpan` the SDK's would
        become, to each processor. One that outgrew the attribute count limit becomes the SDK's own span, which
        decides what it drops."""
        name, attributes, status = ending
        max_attributes = self.max_attributes
        if max_attributes is not None and len(attributes) > max_attributes:
            self.sdk_span(name, dict(attributes), status, begun).end()
            return
        tracer = self.tracer
        span = self.readable_span(
            name, begun.context, begun.parent, tracer.resource, attributes, (), (), _CLIENT,
            tracer.instrumentation_info, status, begun.start_time, time_ns(), tracer._instrumentation_scope,
        )  # fmt: skip
        known = self.batch_on_end
        for processor in tracer.span_processor._span_processors:  # SynchronousMultiSpanProcessor.on_end's loop
            # The SDK's BatchSpanProcessor.on_end (as looked up now: on the class, not replaced on the instance)
            # only hands a sampled span, as a direct one is, to its batch.
            if type(processor).on_end is known and "on_end" not in processor.__dict__:
                processor._batch_processor.emit(span)
            else:
                processor.on_end(span)

    def sdk_span(self, name: str, attributes: Mapping[str, Any], status: trace.Status, begun: Begun) -> Any:
        """The SDK's own span for one `begin` started (as `Tracer.start_span` makes it, started at its start
        time): what records an exception, so that its event is the SDK's."""
        tracer = self.tracer
        span = self.sdk_span_type(
            name=name,
            context=begun.context,
            parent=begun.parent,
            sampler=tracer.sampler,
            resource=tracer.resource,
            attributes=attributes,
            span_processor=tracer.span_processor,
            kind=_CLIENT,
            links=(),
            instrumentation_info=tracer.instrumentation_info,
            limits=tracer._span_limits,
            instrumentation_scope=tracer._instrumentation_scope,
        )
        span.start(start_time=begun.start_time)
        if status.status_code is not _UNSET:
            span.set_status(status)
        return span

    def _facts(self, parent: trace.SpanContext) -> _Facts:
        """What a child of `parent` is, remembered per parent (held, so its id names no other while it is) for at
        most REMEMBERED_PARENTS at once: a worker runs many rollouts at a time, each a parent of its calls."""
        known = self._by_parent.get(id(parent))
        if known is not None and known[0] is parent:
            self._last = known
            return known
        last: _Facts
        if not parent.is_valid:
            last = (parent, DIRECT if self._direct_root else SDK, None, None, None, None, "", "")
        else:
            flags, remote = parent.trace_flags, parent.is_remote
            sampled = flags.sampled
            if self._direct_child[remote][sampled]:
                way = DIRECT
            else:
                way = DROP if not sampled and self._dropped_child[remote] else SDK
            child_flags = _SAMPLED_RANDOM if flags.random_trace_id else _SAMPLED
            head, tail = "00-%032x-" % parent.trace_id, "-%02x" % child_flags  # noqa: UP031
            last = (parent, way, parent.trace_id, child_flags, parent.trace_state, parent, head, tail)
        if len(self._by_parent) >= REMEMBERED_PARENTS:
            self._by_parent.clear()
        self._by_parent[id(parent)] = self._last = last
        return last


def context_getter() -> Callable[[], Any]:
    """`opentelemetry.context.get_current` without its two Python calls, where the runtime context is the API's
    default one (a ContextVar, chosen once when the API is imported): that variable's own `get`."""
    from opentelemetry import context
    from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext

    runtime = getattr(context, "_RUNTIME_CONTEXT", None)
    variable = getattr(runtime, "_current_context", None)
    if type(runtime) is ContextVarsRuntimeContext and isinstance(variable, contextvars.ContextVar):
        getter: Callable[[], Any] = variable.get
        return getter
    return context.get_current


def span_plan(tracer: Any) -> SpanPlan | None:
    """The plan for `tracer` as it is now (None: take the SDK's path); re-made whenever its state changes.

    The key is everything of the tracer's state a plan depends on, compared by identity and value on every call
    (an application adding a processor or changing a limit gets a new plan); None: not an SDK tracer as known
    here. Read inline: this runs on every traced call."""
    try:
        processor, limits, config = tracer.span_processor, tracer._span_limits, tracer._tracer_config
        key: _PlanKey | None = (
            tracer, tracer.sampler, tracer.id_generator, processor, processor._span_processors, limits,
            limits.max_span_attributes, limits.max_span_attribute_length, config, config.is_enabled,
            tracer._tracer_metrics,
        )  # fmt: skip
    except AttributeError:
        key = None
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
        sdk_span_type=sdk_span,
        max_attributes=limits.max_span_attributes,
        direct_root=direct_root,
        direct_child=direct_child,
        dropped_unsampled_child=(local_dropped, remote_dropped),
        batch_on_end=BatchSpanProcessor.on_end if _same_code(BatchSpanProcessor.on_end, _batch_on_end) else None,
    )


def _is_random_id_generator(ids: Any) -> bool:
    try:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
    except ImportError:
        return False
    return type(ids) is RandomIdGenerator


def _batch_on_end(self: Any, span: Any) -> None:  # BatchSpanProcessor.on_end as the SDK writes it
    if not (span.context and span.context.trace_flags.sampled):
        return
    self._batch_processor.emit(span)


def _same_code(function: Any, model: Any) -> bool:
    code, known = getattr(function, "__code__", None), model.__code__
    return code is not None and (code.co_code, code.co_consts, code.co_names) == (
        known.co_code, known.co_consts, known.co_names,
    )  # fmt: skip


def _pass(*args: Any, **kwargs: Any) -> None:
    pass


@functools.cache
def _does_nothing(function: Any) -> bool:
    """Whether `function`'s body is a bare `pass` (compiled by this interpreter, as ours is)."""
    return _same_code(function, _pass)
