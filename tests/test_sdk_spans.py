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

from gym_rpc.client import _http_tracing
from gym_rpc.client._http import ObservedCall, RetryPolicy
from gym_rpc.client._rollout import rollout_context
from gym_rpc.client._sdk_spans import DIRECT, DROP, SDK, SpanPlan, _does_nothing, span_plan
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
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
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
        call = ObservedCall(session, "POST", base_url, path, RETRY, True, {"data": b"{}"}, "policy_model")
        try:
            response = await _http_tracing.traced_send(call)
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
