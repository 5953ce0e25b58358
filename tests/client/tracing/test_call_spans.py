"""A traced `ServerClient` call is one CLIENT span made on OpenTelemetry's public API (client/data/_call_spans.py),
exported through the SDK's BatchSpanProcessor to an in-memory exporter, against real aiohttp servers on loopback:
its name, parent, attributes and status; its context in the request's headers, as the global propagator writes
them; no span for a child of an unsampled parent; and `send`'s own coroutine, whichever way the span goes."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gym_rpc.client import rollout_context
from gym_rpc.client.data import _call_spans as _http_tracing
from gym_rpc.client.data._call_spans import is_default_propagator, observer_for
from gym_rpc.client.data._http import Call, send
from gym_rpc.client.resend._policy import RetryPolicy
from gym_rpc.client.server_client import ServerClient
from gym_rpc.errors import ServerUnreachableError
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.servers import start_dropping_server
from tests.support.tracing import Receiver, Traced, WritesNothing, client_for, post

REMOTE_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED_PARENT = trace.SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False)


def under(parent: str, call: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
    """Run `call` inside rollout "r-1" under a parent as rollouts have one: the rollout's own span, a remote
    caller's context (with trace state), or none at all."""

    async def run() -> Any:
        if parent == "rollout":
            with rollout_context("r-1", span=True):
                return await call()
        with rollout_context("r-1"):
            if parent == "remote":
                remote = {"traceparent": REMOTE_TRACEPARENT, "tracestate": "vendor=v1"}
                token = otel_context.attach(propagate.extract(remote))
                try:
                    return await call()
                finally:
                    otel_context.detach(token)
            return await call()

    return run()


def header_of(span: ReadableSpan) -> str:
    context = span.context
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


@pytest.mark.parametrize(
    ("parent", "path", "status_code"),
    [
        pytest.param("rollout", "/200", trace.StatusCode.UNSET, id="answered, under its rollout's span"),
        pytest.param("rollout", "/500", trace.StatusCode.ERROR, id="a 5xx answer: an error"),
        pytest.param("rollout", "/404", trace.StatusCode.ERROR, id="a 4xx answer: a client's error"),
        pytest.param("none", "/200", trace.StatusCode.UNSET, id="a root span"),
        pytest.param("remote", "/200", trace.StatusCode.UNSET, id="a remote parent with trace state"),
    ],
)
async def test_a_call_is_one_client_span_with_the_conventions_attributes_and_its_context_goes_out(
    traced: Callable[..., Traced],
    receiver: Receiver,
    client_of: Callable[[int], ServerClient],
    parent: str,
    path: str,
    status_code: trace.StatusCode,
) -> None:
    made = traced()
    client = client_of(receiver.port)
    status = await under(parent, lambda: post(client, path))
    [span] = made.clients()
    rollouts = [s for s in made.finished() if s.name == "gym.rollout"]
    assert span.name == "POST" and span.status.status_code is status_code
    expected = {
        "http.request.method": "POST",
        "server.address": LOOPBACK,
        "server.port": receiver.port,
        "gym.server.name": "policy_model",
        "url.full": receiver.base_url + path,
        "gym.rollout_id": "r-1",
        "http.response.status_code": status,
    }
    if status >= 400:
        expected["error.type"] = str(status)
    assert dict(span.attributes or {}) == expected
    if parent == "rollout":
        assert span.parent is not None and span.parent.span_id == rollouts[0].context.span_id
    elif parent == "remote":
        assert (
            span.parent is not None
            and span.parent.is_remote
            and f"{span.context.trace_id:032x}" in REMOTE_TRACEPARENT
        )
    else:
        assert span.parent is None
    [request] = receiver.requests
    assert request.headers["traceparent"] == header_of(span)
    assert request.headers.get("tracestate") == ("vendor=v1" if parent == "remote" else None)  # the parent's, on


async def test_a_resent_call_counts_its_resends_and_a_failed_one_records_its_error(
    traced: Callable[..., Traced],
) -> None:
    made = traced()
    dropping, port, connections = await start_dropping_server(drops=1)
    gone = closed_port()
    resent_client, gone_client = client_for(port), client_for(gone)
    try:
        with rollout_context("r-1", span=True):
            assert await post(resent_client, "/v1/responses") == 200
            with pytest.raises(ServerUnreachableError):
                await post(gone_client, "/v1/responses")
    finally:
        await resent_client.aclose()
        await gone_client.aclose()
        dropping.close()
        await dropping.wait_closed()
    resent, failed = made.clients()
    assert connections == [2]
    assert (resent.attributes or {})["http.request.resend_count"] == 1
    assert (resent.attributes or {})["http.response.status_code"] == 200
    failed_attributes = dict(failed.attributes or {})
    assert (failed_attributes["error.type"], failed_attributes["http.request.resend_count"]) == (
        "ServerUnreachableError", 1,
    )  # fmt: skip
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert [event.name for event in failed.events] == ["exception"]


async def test_a_child_of_an_unsampled_parent_makes_no_span_and_carries_the_parent_on(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    """gym_rpc's sampling policy, from the parent's public trace flags: even a sampler that would record every
    span (ALWAYS_ON, not parent-based) gets no call span under an unsampled parent."""
    made = traced(sampler=ALWAYS_ON)
    client = client_of(receiver.port)
    token = otel_context.attach(trace.set_span_in_context(trace.NonRecordingSpan(UNSAMPLED_PARENT)))
    try:
        assert await post(client, "/200") == 200
    finally:
        otel_context.detach(token)
    assert made.finished() == []
    assert receiver.traceparents == ["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"]


async def test_sampled_once_per_rollout_with_the_recommended_sampler(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    """ParentBased(TraceIdRatioBased(r)): each rollout's span is sampled or not, and its calls follow it, all of
    them or none; a dropped rollout's calls carry its context unsampled."""
    made = traced(sampler=ParentBased(TraceIdRatioBased(0.5)))
    client = client_of(receiver.port)
    kept = 0
    for number in range(20):
        with rollout_context(f"r-{number}", span=True):
            rollout = trace.get_current_span().get_span_context()
            for _ in range(3):
                assert await post(client, "/200") == 200
        sent = receiver.traceparents[-3:]
        if rollout.trace_flags.sampled:
            kept += 1
            assert all(header is not None and f"{rollout.trace_id:032x}" in header for header in sent)
        else:
            assert sent == [f"00-{rollout.trace_id:032x}-{rollout.span_id:016x}-{rollout.trace_flags:02x}"] * 3
    calls = made.clients()
    assert len(calls) == 3 * kept and len({span.context.trace_id for span in calls}) == kept


async def test_a_root_the_sampler_drops_makes_no_span_and_sends_its_unsampled_context(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    made = traced(sampler=ALWAYS_OFF)
    assert await post(client_of(receiver.port), "/200") == 200
    assert made.finished() == []
    [header] = receiver.traceparents
    assert header is not None and not int(header[-2:], 16) & trace.TraceFlags.SAMPLED


async def test_baggage_goes_out_with_the_propagator(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    made = traced()
    token = otel_context.attach(baggage.set_baggage("user", "u-1"))
    try:
        assert await post(client_of(receiver.port), "/200") == 200
    finally:
        otel_context.detach(token)
    [span] = made.clients()
    [request] = receiver.requests
    assert (request.headers["traceparent"], request.headers["baggage"]) == (header_of(span), "user=u-1")


async def test_a_propagator_set_between_calls_is_the_one_the_next_call_uses(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    made = traced()
    client = client_of(receiver.port)
    default = propagate.get_global_textmap()
    with rollout_context("r-1", span=True):
        assert await post(client, "/200") == 200
        propagate.set_global_textmap(WritesNothing())
        try:
            assert await post(client, "/200") == 200
        finally:
            propagate.set_global_textmap(default)
        assert await post(client, "/200") == 200
    first, silent, again = receiver.traceparents
    assert first is not None and again is not None and silent is None
    assert len(made.clients()) == 3


async def test_a_call_keeps_the_callers_headers_and_puts_its_traceparent_in_place_of_theirs(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    made = traced()
    given = {"X-Caller": "kept", "TraceParent": f"00-{'1' * 32}-{'2' * 16}-01"}
    assert await post(client_of(receiver.port), "/200", headers=given) == 200
    [span] = made.clients()
    [request] = receiver.requests
    assert (request.headers["traceparent"], request.headers["x-caller"]) == (header_of(span), "kept")
    assert given == {"X-Caller": "kept", "TraceParent": f"00-{'1' * 32}-{'2' * 16}-01"}  # never touched


@pytest.mark.parametrize("unsampled", [False, True], ids=["its own span", "no span: an unsampled parent"])
async def test_a_traced_call_is_sends_own_coroutine(
    traced: Callable[..., Traced], receiver: Receiver, unsampled: bool
) -> None:
    """A traced call is `send`'s coroutine itself, its span chosen beforehand (`observer_for`, no coroutine): a
    coroutine of ours between the caller and aiohttp would cost every resumption of every traced call."""
    made = traced()
    retry = RetryPolicy(attempts=1)
    parent = trace.NonRecordingSpan(UNSAMPLED_PARENT) if unsampled else trace.INVALID_SPAN
    token = otel_context.attach(trace.set_span_in_context(parent))
    try:
        async with aiohttp.ClientSession() as session:
            url = receiver.base_url + "/200"
            call = Call(session, "POST", url, {"data": b"{}"}, retry, server="srv")
            call.observer = observer_for(call, receiver.base_url)
            assert (call.observer is None) is unsampled
            coroutine = send(call)
            assert inspect.iscoroutine(coroutine) and coroutine.cr_code is send.__code__
            async with await coroutine as response:
                assert response.status == 200
    finally:
        otel_context.detach(token)
    assert len(made.clients()) == (0 if unsampled else 1)


@pytest.mark.parametrize(
    ("trace_state", "baggage_items", "flags"),
    [
        ((), {}, 0x01),
        ((), {}, 0x00),
        ((), {}, 0x03),  # sampled, random trace id (the SDK's newer flag)
        ((("vendor", "v1"),), {}, 0x01),
        ((), {"user": "u-1"}, 0x01),
    ],
)
def test_trace_context_headers_are_what_the_global_propagator_writes(
    trace_state: tuple[tuple[str, str], ...], baggage_items: dict[str, str], flags: int
) -> None:
    """The plain `traceparent` rule, and the propagator's path for trace state and baggage, send exactly the
    headers `opentelemetry.propagate.inject` would, and never touch the caller's headers."""
    span = trace.NonRecordingSpan(
        trace.SpanContext(
            0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=False,
            trace_flags=trace.TraceFlags(flags), trace_state=trace.TraceState(list(trace_state)),
        )
    )  # fmt: skip
    context = otel_context.get_current()
    for key, value in baggage_items.items():
        context = baggage.set_baggage(key, value, context)
    token = otel_context.attach(context)
    try:
        given = {"X-Mine": "1", "TraceParent": "00-ffffffffffffffffffffffffffffffff-ffffffffffffffff-01"}
        ours = _http_tracing.trace_context_headers(given, span.get_span_context())
        expected: dict[str, str] = {}
        propagate.inject(expected, context=trace.set_span_in_context(span))
    finally:
        otel_context.detach(token)
    assert {k.lower(): v for k, v in ours.items()} == {"x-mine": "1", **expected}
    assert given["TraceParent"].startswith("00-ffff")  # the caller's mapping is untouched


def test_the_default_propagator_is_told_by_public_facts_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain rule is taken only for the propagator the first traced call saw, when that one is a
    CompositePropagator with W3C's fields: any propagator set later, or of another kind, goes through inject."""
    monkeypatch.setattr(_http_tracing, "_first_textmap", None)
    process_default = propagate.get_global_textmap()  # OTEL_PROPAGATORS unset: W3C trace context and baggage
    assert is_default_propagator(process_default)
    assert not is_default_propagator(
        CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    )
    assert is_default_propagator(process_default)
    for first in (TraceContextTextMapPropagator(), CompositePropagator([WritesNothing(), FieldsOfItsOwn()])):
        monkeypatch.setattr(_http_tracing, "_first_textmap", None)
        assert not is_default_propagator(first)
        assert not is_default_propagator(first)


class FieldsOfItsOwn(W3CBaggagePropagator):
    @property
    def fields(self) -> set[str]:
        return {"x-trace"}


async def test_a_503_answer_is_backpressure_resent_and_its_span_counts_the_resends(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    """A 503 from a server of one instance is backpressure (resent within http_client.retry.backpressure, 4
    attempts by default): the one span of the call counts the resends and ends with the last answer, an error."""
    made = traced()
    client = client_of(receiver.port)
    assert await under("rollout", lambda: post(client, "/503")) == 503
    [span] = made.clients()
    attributes = dict(span.attributes or {})
    assert (attributes["http.request.resend_count"], attributes["http.response.status_code"]) == (3, 503)
    assert span.status.status_code is trace.StatusCode.ERROR and len(receiver.requests) == 4
