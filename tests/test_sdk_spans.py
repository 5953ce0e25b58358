"""gym_rpc.client._sdk_spans: a traced call's CLIENT span built directly exports exactly what the SDK's own
`Tracer.start_span` + `end` export (both paths, field by field, through a BatchSpanProcessor to an in-memory
exporter, real aiohttp servers on loopback); every condition the module proves falls back to the SDK's path when it
does not hold; and the SDK internals it reads are where it reads them (this test fails loudly on an SDK upgrade
that moves them).

The SDK's path is taken for comparison with a sampler that decides exactly as the default one but is not the SDK's
class (`SameSampler`): the module cannot prove what it does, so the SDK works as it always did.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gym_rpc.client import _http_tracing
from gym_rpc.client._http import RetryPolicy, send
from gym_rpc.client._rollout import rollout_context
from gym_rpc.client._sdk_spans import (
    DIRECT,
    DROP,
    SDK,
    SpanPlan,
    _batch_on_end,
    _does_nothing,
    _same_code,
    span_plan,
)
from gym_rpc.errors import ServerUnreachableError
from gym_rpc.telemetry import TRACER_NAME
from tests.raw_servers import LOOPBACK, start_dropping_server

RETRY = RetryPolicy(attempts=2, initial_backoff_seconds=0.01, max_backoff_seconds=0.01)


class SameSampler(ParentBased):
    """The SDK's default decisions, in a class of its own: the module cannot prove what it does."""

    def __init__(self) -> None:
        super().__init__(ALWAYS_ON)

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return super().should_sample(*args, **kwargs)


class TaggingSampler(Sampler):
    """Samples everything and adds an attribute: what a sampler may do."""

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        parent = trace.get_current_span(parent_context).get_span_context()
        state = parent.trace_state if parent.is_valid else None
        return SamplingResult(Decision.RECORD_AND_SAMPLE, {**(attributes or {}), "tagged": 1}, state)

    def get_description(self) -> str:
        return "tagging"


class StartCounter(SpanProcessor):
    """A processor that looks at spans when they start: only the SDK's own spans can be shown to it."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.started.append(span.name)


@dataclass
class Traced:
    """A provider with a batching processor into an in-memory exporter; its tracer is gym_rpc's for the test."""

    provider: TracerProvider
    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)

    def __post_init__(self) -> None:
        self.processor = BatchSpanProcessor(self.exporter)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(TRACER_NAME, "test")

    def finished(self) -> list[ReadableSpan]:
        assert self.provider.force_flush(10_000)
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Traced]]:
    """Make a `Traced` from TracerProvider arguments and use its tracer for traced calls (never installed as the
    global provider: the suite's other tests keep theirs)."""
    made: list[Traced] = []

    def make(**provider_arguments: Any) -> Traced:
        result = Traced(TracerProvider(shutdown_on_exit=False, **provider_arguments))
        monkeypatch.setattr(_http_tracing, "tracer", lambda: result.tracer)
        made.append(result)
        return result

    yield make
    for result in made:
        result.provider.shutdown()


@dataclass
class Receiver:
    """A loopback server answering /<status> with that status, noting every traceparent it gets."""

    base_url: str
    traceparents: list[str | None]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    traceparents: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        traceparents.append(request.headers.get("traceparent"))
        await request.read()
        return web.Response(status=int(request.match_info["status"]), text="{}")

    app = web.Application()
    app.router.add_route("*", "/{status:[0-9]+}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    yield Receiver(f"http://{LOOPBACK}:{runner.addresses[0][1]}", traceparents)
    await runner.cleanup()


async def post(base_url: str, path: str) -> int | BaseException:
    """One traced POST as ServerClient makes it (a fresh session: no pooled connection between paths)."""
    async with aiohttp.ClientSession() as session:
        url = base_url + path
        try:
            response = await _http_tracing.traced_send(
                session, "POST", base_url, url, RETRY, True, {"data": b"{}"}, "policy_model"
            )
        except (ServerUnreachableError, aiohttp.ClientError) as error:
            return error
        async with response:
            await response.read()
        return response.status


async def under_parent(parent: str, tracer: trace.Tracer, call: Callable[[], Awaitable[Any]]) -> Any:
    """Run `call` under a parent as rollouts have one: a local rollout span, a remote caller's context, or none."""
    with rollout_context("r-1"):
        if parent == "rollout":
            with tracer.start_as_current_span("gym.rollout"):
                return await call()
        if parent == "remote":
            traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            remote = {"traceparent": traceparent, "tracestate": "v=1"}
            token = otel_context.attach(propagate.extract(remote))
            try:
                return await call()
            finally:
                otel_context.detach(token)
        return await call()


def attributes_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def comparable(span: ReadableSpan) -> dict[str, Any]:
    """Every exported field, ids as their relation to the parent (they are random), times as their order."""
    parent = span.parent
    with warnings.catch_warnings():  # instrumentation_info is deprecated, and still exported
        warnings.simplefilter("ignore", DeprecationWarning)
        info = span.instrumentation_info
    return {
        "name": span.name,
        "kind": span.kind,
        "parent": None if parent is None else (parent.is_remote, parent.trace_flags, parent.trace_state),
        "same trace as parent": parent is None or span.context.trace_id == parent.trace_id,
        "context": (span.context.is_remote, span.context.trace_flags, span.context.trace_state),
        "attributes": list(attributes_of(span).items()),
        "dropped": (span.dropped_attributes, span.dropped_events, span.dropped_links),
        "status": (span.status.status_code, span.status.description),
        "events": [(event.name, dict(event.attributes or {})) for event in span.events],
        "links": list(span.links),
        "resource": span.resource.to_json(),
        "scope": span.instrumentation_scope,
        "info": info,
        "times in order": span.start_time is not None and span.end_time is not None
        and span.start_time <= span.end_time,
    }  # fmt: skip


async def exported_call(traced: Traced, parent: str, base_url: str, path: str) -> tuple[Any, ReadableSpan]:
    outcome = await under_parent(parent, traced.tracer, lambda: post(base_url, path))
    clients = [s for s in traced.finished() if s.kind is trace.SpanKind.CLIENT]
    assert len(clients) == 1
    return outcome, clients[0]


def plan_for(traced: Traced) -> SpanPlan | None:
    return span_plan(traced.tracer)


CASES = [
    pytest.param("rollout", "/200", id="answered, under a rollout span"),
    pytest.param("rollout", "/503", id="5xx answer: error status"),
    pytest.param("rollout", "/404", id="4xx answer: a client's error"),
    pytest.param("none", "/200", id="a root span"),
    pytest.param("remote", "/200", id="a remote parent with trace state"),
]


@pytest.mark.parametrize(("parent", "path"), CASES)
async def test_a_direct_span_exports_what_the_sdks_own_does(
    traced: Callable[..., Traced], receiver: Receiver, parent: str, path: str
) -> None:
    direct = traced()
    assert plan_for(direct) is not None
    direct_outcome, direct_span = await exported_call(direct, parent, receiver.base_url, path)
    sdk = traced(sampler=SameSampler())
    assert plan_for(sdk) is None
    sdk_outcome, sdk_span = await exported_call(sdk, parent, receiver.base_url, path)

    assert direct_outcome == sdk_outcome == int(path[1:])
    assert comparable(direct_span) == comparable(sdk_span)
    assert attributes_of(direct_span)["gym.rollout_id"] == "r-1"
    for span, sent in zip((direct_span, sdk_span), receiver.traceparents, strict=True):  # what went out is it
        context = span.context
        assert sent == f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


async def test_a_resent_call_and_a_failed_one_export_what_the_sdks_own_do(
    traced: Callable[..., Traced], receiver: Receiver
) -> None:
    """A call resent once (resend count), and one that fails (the exception event, error status and type: the
    direct span becomes the SDK's own to record them)."""
    refused_port = await free_port()
    server, port, _ = await start_dropping_server(lambda number: number % 2 == 1)  # each call is resent once
    for base_url in (f"http://{LOOPBACK}:{port}", f"http://{LOOPBACK}:{refused_port}"):
        outcomes, spans = [], []
        for sampler in (None, SameSampler()):  # the direct path, then the SDK's
            outcome, span = await exported_call(traced(sampler=sampler), "rollout", base_url, "/v1/responses")
            outcomes.append(outcome)
            spans.append(comparable(span))
        direct, sdk = spans
        assert direct == sdk
        assert ("http.request.resend_count", 1) in direct["attributes"]
        if base_url.endswith(str(port)):
            assert outcomes == [200, 200]
        else:
            assert all(isinstance(outcome, ServerUnreachableError) for outcome in outcomes)
            assert direct["status"][0] is trace.StatusCode.ERROR
            assert [name for name, _ in direct["events"]] == ["exception"]
    server.close()
    await server.wait_closed()


async def free_port() -> int:
    server = await asyncio.start_server(lambda r, w: None, LOOPBACK, 0)
    port = int(server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()
    return port


# --- every condition falls back to the SDK's path ----------------------------------------------------------------


def not_direct(traced: Traced, parent: trace.SpanContext) -> bool:
    plan = plan_for(traced)
    return plan is None or plan.way(parent) is not DIRECT


SAMPLED_LOCAL = trace.SpanContext(1, 2, False, trace.TraceFlags(1))
# No parent (a root), then sampled and unsampled, local and remote parents.
PARENTS = [
    trace.INVALID_SPAN_CONTEXT,
    SAMPLED_LOCAL,
    trace.SpanContext(1, 2, False, trace.TraceFlags(0)),
    trace.SpanContext(1, 2, True, trace.TraceFlags(1)),
    trace.SpanContext(1, 2, True, trace.TraceFlags(0)),
]


@pytest.mark.parametrize(
    "provider_arguments",
    [
        pytest.param({"sampler": SameSampler()}, id="a sampler of another class"),
        pytest.param(
            {"sampler": ParentBased(ALWAYS_ON, local_parent_sampled=TraceIdRatioBased(1.0))},
            id="a parent-based sampler whose delegate is not always-on",
        ),
        pytest.param({"span_limits": SpanLimits(max_span_attribute_length=64)}, id="a value length limit"),
        pytest.param(
            {"active_span_processor": sdk_trace.ConcurrentMultiSpanProcessor()}, id="concurrent processors"
        ),
    ],
)
def test_what_cannot_be_proven_takes_the_sdks_path(
    traced: Callable[..., Traced], provider_arguments: dict[str, Any]
) -> None:
    assert not_direct(traced(**provider_arguments), SAMPLED_LOCAL)


def test_the_sdks_internal_metrics_take_the_sdks_path(
    traced: Callable[..., Traced], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")  # read when the tracer is made
    assert plan_for(traced()) is None


async def test_a_sampler_that_adds_attributes_is_obeyed(traced: Callable[..., Traced], receiver: Receiver) -> None:
    tagging = traced(sampler=TaggingSampler())
    assert not_direct(tagging, SAMPLED_LOCAL)
    _, span = await exported_call(tagging, "rollout", receiver.base_url, "/200")
    assert attributes_of(span)["tagged"] == 1


async def test_span_limits_are_the_sdks(traced: Callable[..., Traced], receiver: Receiver) -> None:
    """A value length limit takes the SDK's path; a count limit a span outgrows makes it the SDK's at its end:
    both export what the SDK does."""
    truncating = traced(span_limits=SpanLimits(max_span_attribute_length=4))
    _, span = await exported_call(truncating, "rollout", receiver.base_url, "/200")
    assert attributes_of(span)["gym.server.name"] == "poli"
    counting = traced(span_limits=SpanLimits(max_span_attributes=3))
    assert not not_direct(counting, SAMPLED_LOCAL)
    _, direct = await exported_call(counting, "rollout", receiver.base_url, "/200")
    sdk = traced(span_limits=SpanLimits(max_span_attributes=3), sampler=SameSampler())
    _, reference = await exported_call(sdk, "rollout", receiver.base_url, "/200")
    assert comparable(direct) == comparable(reference)
    assert len(attributes_of(direct)) == 3 and direct.dropped_attributes > 0


async def test_a_processor_added_later_sees_the_sdks_spans(
    traced: Callable[..., Traced], receiver: Receiver
) -> None:
    """The plan follows the tracer's state: a processor that looks at starting spans, added after calls were
    made, gets the SDK's path from the next call on (and a plain batching one keeps the direct path)."""
    current = traced()
    await exported_call(current, "rollout", receiver.base_url, "/200")
    current.provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    assert not not_direct(current, SAMPLED_LOCAL)
    counter = StartCounter()
    current.provider.add_span_processor(counter)
    assert not_direct(current, SAMPLED_LOCAL)
    assert await under_parent("rollout", current.tracer, lambda: post(receiver.base_url, "/200")) == 200
    assert counter.started == ["gym.rollout", "POST"]
    assert [s.kind for s in current.finished()] == [trace.SpanKind.CLIENT, trace.SpanKind.INTERNAL] * 2


def test_unsampled_parents_children_are_dropped_only_when_the_sampler_says_so(
    traced: Callable[..., Traced],
) -> None:
    default = plan_for(traced())
    assert default is not None
    assert [default.way(parent) for parent in PARENTS] == [DIRECT, DIRECT, DROP, DIRECT, DROP]
    remote_kept = plan_for(traced(sampler=ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON)))
    assert remote_kept is not None
    assert [remote_kept.way(parent) for parent in PARENTS] == [DIRECT, DIRECT, DROP, DIRECT, DIRECT]
    assert plan_for(traced(sampler=SameSampler())) is None
    always_on = plan_for(traced(sampler=ALWAYS_ON))
    assert always_on is not None and {always_on.way(parent) for parent in PARENTS} == {DIRECT}
    ratio_root = plan_for(traced(sampler=ParentBased(TraceIdRatioBased(0.5))))
    assert ratio_root is not None
    assert [ratio_root.way(parent) for parent in PARENTS] == [SDK, DIRECT, DROP, DIRECT, DROP]


# --- the SDK internals this module reads -------------------------------------------------------------------------


def test_the_sdk_internals_read_are_where_they_were(traced: Callable[..., Traced]) -> None:
    """If this fails after an SDK upgrade, gym_rpc.client._sdk_spans must be re-proven against the new SDK."""
    tracer: Any = traced().tracer
    assert type(tracer) is sdk_trace.Tracer
    assert type(tracer._tracer_metrics) is NoOpTracerMetrics
    assert tracer._tracer_config.is_enabled is True
    assert isinstance(tracer._span_limits, SpanLimits) and tracer._span_limits.max_span_attribute_length is None
    assert tracer._instrumentation_scope.name == TRACER_NAME
    assert type(tracer.span_processor) is sdk_trace.SynchronousMultiSpanProcessor
    assert [type(p) for p in tracer.span_processor._span_processors] == [BatchSpanProcessor]
    assert issubclass(sdk_trace._Span, sdk_trace.Span)
    for processor in (BatchSpanProcessor, SimpleSpanProcessor):
        assert _does_nothing(processor.on_start) and _does_nothing(processor._on_ending)
    assert not _does_nothing(BatchSpanProcessor.on_end)
    assert isinstance(DEFAULT_ON, ParentBased) and DEFAULT_ON._root is ALWAYS_ON
    assert (DEFAULT_ON._local_parent_sampled, DEFAULT_ON._remote_parent_sampled) == (ALWAYS_ON, ALWAYS_ON)
    not_sampled = (DEFAULT_ON._local_parent_not_sampled, DEFAULT_ON._remote_parent_not_sampled)
    assert not_sampled == (ALWAYS_OFF, ALWAYS_OFF)
    assert isinstance(ALWAYS_ON, StaticSampler) and ALWAYS_ON._decision is Decision.RECORD_AND_SAMPLE
    assert ALWAYS_OFF._decision is Decision.DROP
    plan = span_plan(tracer)
    assert plan is not None
    assert [plan.way(parent) for parent in PARENTS] == [DIRECT, DIRECT, DROP, DIRECT, DROP]


def _reference_generate_span_id(self: Any) -> int:  # RandomIdGenerator.generate_span_id, which begin inlines
    span_id = random.getrandbits(64)
    while span_id == trace.INVALID_SPAN_ID:
        span_id = random.getrandbits(64)
    return span_id


def _reference_multi_on_end(self: Any, span: Any) -> None:  # the loop SpanPlan.finish makes itself
    for sp in self._span_processors:
        sp.on_end(span)


def _reference_multi_on_start(self: Any, span: Any, parent_context: Any = None) -> None:
    for sp in self._span_processors:
        sp.on_start(span, parent_context=parent_context)


def _reference_multi_on_ending(self: Any, span: Any) -> None:
    for sp in self._span_processors:
        sp._on_ending(span)


def test_the_context_getter_is_the_apis_context_variable_and_answers_as_get_current() -> None:
    """traced_send reads the current context with the runtime context's own ContextVar.get (context_getter): the
    API's default runtime context still keeps it there, and it answers what get_current does, attached or not."""
    runtime: Any = otel_context._RUNTIME_CONTEXT
    assert type(runtime).__name__ == "ContextVarsRuntimeContext"
    assert _http_tracing._current_context == runtime._current_context.get  # the variable's own bound get
    assert _http_tracing._current_context() is otel_context.get_current()
    token = otel_context.attach(otel_context.set_value("gym-rpc-test", 1))
    try:
        assert _http_tracing._current_context() is otel_context.get_current()
        assert otel_context.get_value("gym-rpc-test", _http_tracing._current_context()) == 1
    finally:
        otel_context.detach(token)


def test_the_sdk_code_the_direct_span_stands_in_for_is_what_it_was() -> None:
    """What SpanPlan.begin and finish do in the SDK's stead: ReadableSpan taken positionally, SpanContext's tuple
    made without its checks, RandomIdGenerator's span id inline, the processors' loop and a known batching on_end
    replaced by its emit. If this fails after an SDK upgrade, gym_rpc.client._sdk_spans must be re-proven."""
    parameters = list(inspect.signature(ReadableSpan.__init__).parameters.values())[1:]
    assert [p.name for p in parameters] == [
        "name", "context", "parent", "resource", "attributes", "events", "links", "kind", "instrumentation_info",
        "status", "start_time", "end_time", "instrumentation_scope",
    ]  # fmt: skip
    assert {p.kind for p in parameters} == {inspect.Parameter.POSITIONAL_OR_KEYWORD}

    trace_id, span_id = 0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7
    ways = (
        (trace.TraceFlags(1), trace.DEFAULT_TRACE_STATE),
        (trace.TraceFlags(3), trace.TraceState([("v", "1")])),
    )
    for flags, state in ways:
        made = tuple.__new__(trace.SpanContext, (trace_id, span_id, False, flags, state, True))
        checked = trace.SpanContext(trace_id, span_id, False, flags, state)
        assert made == checked and type(made) is type(checked) is trace.SpanContext
        fields = ("trace_id", "span_id", "is_remote", "trace_flags", "trace_state", "is_valid")
        assert [getattr(made, name) for name in fields] == [getattr(checked, name) for name in fields]
        assert [getattr(made, name) for name in fields] == [trace_id, span_id, False, flags, state, True]
    assert trace.SpanContext(trace_id, span_id, False, trace.TraceFlags(1), None).trace_state is (
        trace.DEFAULT_TRACE_STATE
    )  # what begin gives a root span

    assert _same_code(BatchSpanProcessor.on_end, _batch_on_end)  # finish hands a batch the span as it would
    assert not _same_code(SimpleSpanProcessor.on_end, _batch_on_end)
    assert trace.INVALID_SPAN_ID == 0  # begin's inline check
    assert _same_code(RandomIdGenerator.generate_span_id, _reference_generate_span_id)
    assert not _same_code(RandomIdGenerator.generate_trace_id, _reference_generate_span_id)  # it tells them apart
    multi = sdk_trace.SynchronousMultiSpanProcessor
    assert _same_code(multi.on_end, _reference_multi_on_end)
    # A direct span skips the multi-processor's on_start and _on_ending: only its processors' (which do nothing).
    assert _same_code(multi.on_start, _reference_multi_on_start)
    assert _same_code(multi._on_ending, _reference_multi_on_ending)


# --- what the direct path is given, it uses ----------------------------------------------------------------------


class KnownIds(IdGenerator):
    """An application's id generator: known ids, in the order asked for."""

    def __init__(self) -> None:
        self.span_ids = iter([0x00F067AA0BA902B7, 0x00F067AA0BA902B8, 0x00F067AA0BA902B9])

    def generate_trace_id(self) -> int:
        return 0x4BF92F3577B34DA6A3CE929D0E0E4736

    def generate_span_id(self) -> int:
        return next(self.span_ids)


@pytest.mark.parametrize(
    ("parent", "traceparent"),
    [
        pytest.param("none", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", id="a root span"),
        pytest.param("rollout", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b8-01", id="a rollout's call"),
    ],
)
async def test_a_tracers_own_id_generator_makes_a_direct_spans_ids(
    traced: Callable[..., Traced], receiver: Receiver, parent: str, traceparent: str
) -> None:
    """Only RandomIdGenerator's span ids are made inline: any other generator is asked, as the SDK asks it (its
    trace id for a root, not random: flags 01), and its ids are the span's and the server's traceparent's."""
    direct = traced(id_generator=KnownIds())
    assert plan_for(direct) is not None
    _, direct_span = await exported_call(direct, parent, receiver.base_url, "/200")
    sdk = traced(id_generator=KnownIds(), sampler=SameSampler())
    assert plan_for(sdk) is None
    _, sdk_span = await exported_call(sdk, parent, receiver.base_url, "/200")

    assert receiver.traceparents == [traceparent, traceparent]
    assert (direct_span.context.trace_id, direct_span.context.span_id) == (
        0x4BF92F3577B34DA6A3CE929D0E0E4736,
        int(traceparent[36:52], 16),
    )
    assert direct_span.context == sdk_span.context and direct_span.parent == sdk_span.parent
    assert comparable(direct_span) == comparable(sdk_span)


async def three_posts(base_url: str) -> list[int | BaseException]:
    return [await post(base_url, "/v1/responses") for _ in range(3)]


async def test_a_rollouts_calls_share_attributes_only_while_they_are_the_same(
    traced: Callable[..., Traced],
) -> None:
    """Three calls of one rollout to one URL, the third resent once: the first two have equal attributes (shared
    by the direct path) and no resend count, the third its own with `http.request.resend_count` 1 (and the first
    two are not changed by it); each exports what the SDK's path does for the same calls."""
    server, port, connections = await start_dropping_server(lambda number: number in (3, 7))  # each third call
    base_url = f"http://{LOOPBACK}:{port}"
    exported = []
    try:
        for sampler in (None, SameSampler()):  # the direct path, then the SDK's
            made = traced(sampler=sampler)
            assert (plan_for(made) is None) is (sampler is not None)
            assert await under_parent("rollout", made.tracer, lambda: three_posts(base_url)) == [200, 200, 200]
            exported.append([comparable(s) for s in made.finished() if s.kind is trace.SpanKind.CLIENT])
    finally:
        server.close()
        await server.wait_closed()
    assert connections == [8]
    direct, sdk = exported
    assert direct == sdk
    first, second, third = (dict(span["attributes"]) for span in direct)
    assert (
        first
        == second
        == {
            "http.request.method": "POST",
            "server.address": LOOPBACK,
            "server.port": port,
            "gym.server.name": "policy_model",
            "url.full": f"{base_url}/v1/responses",
            "gym.rollout_id": "r-1",
            "http.response.status_code": 200,
        }
    )
    assert third == {**first, "http.request.resend_count": 1}
    assert list(third)[-2:] == ["http.request.resend_count", "http.response.status_code"]  # the SDK's order


@pytest.mark.parametrize("where", ["class", "instance"])
async def test_a_processors_on_end_replaced_after_the_plan_is_made_gets_the_direct_span(
    traced: Callable[..., Traced], receiver: Receiver, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A direct span goes to each processor's `on_end` as looked up at its end, as the SDK's multi-processor does:
    one replaced later (on the class, or on the instance as mock.patch.object does) gets it."""
    patched = traced()
    plan = plan_for(patched)
    assert plan is not None and plan.way(SAMPLED_LOCAL) is DIRECT
    processor = patched.processor
    seen: list[ReadableSpan] = []
    known_on_end = BatchSpanProcessor.on_end

    def on_end(self: BatchSpanProcessor, span: ReadableSpan) -> None:
        seen.append(span)
        known_on_end(self, span)

    if where == "class":
        monkeypatch.setattr(BatchSpanProcessor, "on_end", on_end)
    else:
        monkeypatch.setattr(processor, "on_end", lambda span: on_end(processor, span))
    _, span = await exported_call(patched, "rollout", receiver.base_url, "/200")
    assert [(s.name, s.kind) for s in seen] == [
        ("POST", trace.SpanKind.CLIENT),
        ("gym.rollout", trace.SpanKind.INTERNAL),
    ]
    assert seen[0] is span  # the direct span, given to on_end and exported by it


def unsampled_parent() -> otel_context.Context:
    parent = trace.SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False, trace.TraceFlags(0))
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


@pytest.mark.parametrize(
    ("sampler", "unsampled", "way"),
    [
        pytest.param(None, False, DIRECT, id="a direct span"),
        pytest.param(SameSampler(), False, SDK, id="the sdk's span"),
        pytest.param(None, True, DROP, id="no span: an unsampled parent"),
    ],
)
async def test_a_traced_call_is_sends_own_coroutine(
    traced: Callable[..., Traced], receiver: Receiver, sampler: Sampler | None, unsampled: bool, way: str
) -> None:
    """traced_send returns `send`'s coroutine itself, whichever way the span goes: a coroutine of ours between the
    caller and aiohttp would cost every resumption of every traced call."""
    made = traced(sampler=sampler)
    token = otel_context.attach(unsampled_parent() if unsampled else otel_context.get_current())
    try:
        parent = trace.get_current_span().get_span_context()
        plan = plan_for(made)
        assert (SDK if plan is None else plan.way(parent)) == way
        async with aiohttp.ClientSession() as session:
            base, url = receiver.base_url, receiver.base_url + "/200"
            coroutine = _http_tracing.traced_send(session, "POST", base, url, RETRY, True, {"data": b"{}"}, "srv")
            assert inspect.iscoroutine(coroutine) and coroutine.cr_code is send.__code__
            async with await coroutine as response:
                assert response.status == 200
    finally:
        otel_context.detach(token)
    spans = made.finished()
    if way is DROP:  # the parent's context, carried on
        assert (spans, receiver.traceparents) == ([], ["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"])
    else:
        [context] = [span.context for span in spans]
        # A root span: sampled, its trace id random (RandomIdGenerator's).
        assert receiver.traceparents == [f"00-{context.trace_id:032x}-{context.span_id:016x}-03"]


class WritesNothing(TraceContextTextMapPropagator):
    """A propagator of its own (not the default one) that carries nothing."""

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        pass


async def test_a_propagator_set_after_traced_calls_is_the_one_the_next_call_uses(
    traced: Callable[..., Traced], receiver: Receiver
) -> None:
    """The route a rollout's calls share remembers that the default propagator needs only a traceparent; set
    another one and the next call of the same rollout goes through it (here: no traceparent at all)."""
    made = traced()
    default = propagate.get_global_textmap()
    with rollout_context("r-1"), made.tracer.start_as_current_span("gym.rollout"):
        assert await post(receiver.base_url, "/200") == 200
        propagate.set_global_textmap(WritesNothing())
        try:
            assert await post(receiver.base_url, "/200") == 200
        finally:
            propagate.set_global_textmap(default)
        assert await post(receiver.base_url, "/200") == 200
    first, silent, again = receiver.traceparents
    assert first is not None and again is not None and silent is None
    assert len([s for s in made.finished() if s.kind is trace.SpanKind.CLIENT]) == 3


@pytest.mark.parametrize("unsampled", [False, True], ids=["a direct span", "no span: an unsampled parent"])
async def test_a_traced_call_keeps_the_callers_headers_and_puts_its_own_traceparent_in_place_of_theirs(
    traced: Callable[..., Traced], unsampled: bool
) -> None:
    """The direct and the dropped paths build the headers themselves when only a traceparent is to be added: the
    caller's other headers go out as given, a traceparent of theirs (in any case) is replaced by the span's (with
    no span, the unsampled parent's), and their mapping is never touched."""
    made = traced()
    seen: list[tuple[list[str], str | None]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.headers.getall("traceparent", []), request.headers.get("x-caller")))
        return web.Response(text="{}")

    app = web.Application()
    app.router.add_post("/", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    base = f"http://{LOOPBACK}:{runner.addresses[0][1]}"
    given = {"X-Caller": "kept", "TraceParent": f"00-{'1' * 32}-{'2' * 16}-01"}
    token = otel_context.attach(unsampled_parent() if unsampled else otel_context.get_current())
    rollout_span = contextlib.nullcontext() if unsampled else made.tracer.start_as_current_span("gym.rollout")
    try:
        with rollout_context("r-1"), rollout_span:
            plan = plan_for(made)
            assert plan is not None and plan.way(trace.get_current_span().get_span_context()) == (
                DROP if unsampled else DIRECT
            )
            async with aiohttp.ClientSession() as session:
                response = await _http_tracing.traced_send(
                    session, "POST", base, f"{base}/", RETRY, True, {"data": b"{}", "headers": given}, "srv"
                )
                async with response:
                    assert response.status == 200
    finally:
        otel_context.detach(token)
        await runner.cleanup()
    calls = [s for s in made.finished() if s.kind is trace.SpanKind.CLIENT]
    if unsampled:
        assert calls == []
        assert seen == [(["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"], "kept")]
    else:
        [span] = calls
        ids = (span.context.trace_id, span.context.span_id, span.context.trace_flags)
        assert seen == [(["00-%032x-%016x-%02x" % ids], "kept")]  # noqa: UP031
    assert given == {"X-Caller": "kept", "TraceParent": f"00-{'1' * 32}-{'2' * 16}-01"}


class FailingOnEnd(SpanProcessor):
    """A processor whose on_end raises: the SDK's multi-processor hands it on to whoever ended the span."""

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("a processor that fails")


class ToldAnswers:
    """A second observer noting the answers it is told of."""

    def __init__(self) -> None:
        self.answers: list[aiohttp.ClientResponse] = []

    def resent(self, attempt: int, kind: str) -> None:
        pass

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        self.answers.append(response)

    def failed(self, error: BaseException, attempts: int) -> None:
        pass


async def test_the_other_observer_is_told_before_the_spans_work_which_may_raise(
    traced: Callable[..., Traced], receiver: Receiver
) -> None:
    """traced_send's `also` (the worker metrics') hears the answer before the span ends; a processor that raises at
    the span's end never fails the call (send logs the observer's error once) nor leaks its response."""
    made = traced()
    made.provider.add_span_processor(FailingOnEnd())
    also = ToldAnswers()
    async with aiohttp.ClientSession() as session:
        base, url = receiver.base_url, receiver.base_url + "/200"
        response = await _http_tracing.traced_send(
            session, "POST", base, url, RETRY, True, {"data": b"{}"}, "srv", also
        )
        async with response:
            assert response.status == 200
        assert also.answers == [response]
