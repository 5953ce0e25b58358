"""The headers of calls under an unsampled parent are made once per OpenTelemetry context and shared
(client/tracing/_unsampled_headers.py): the same read-only object for every call of a rollout its sampler dropped,
what the global propagator writes, never the caller's headers, remade when the context or the propagator changes,
and forgotten when the rollout ends. Real calls to a loopback aiohttp server, real SDK provider."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from multidict import CIMultiDictProxy
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from gym_rpc.client import rollout_context
from gym_rpc.client.data._call_spans import call_span
from gym_rpc.client.data._http import Call
from gym_rpc.client.resend import RetryPolicy
from gym_rpc.client.server_client import ServerClient
from gym_rpc.client.tracing import _unsampled_headers
from gym_rpc.client.tracing._unsampled_headers import known_headers
from tests.support.tracing import Receiver, Traced, WritesNothing, post

if TYPE_CHECKING:
    from aiohttp.client import _RequestOptions

DROPPED = ParentBased(ALWAYS_OFF)  # every rollout's span unsampled, as 9 in 10 are at a ratio of 0.1


def expected_traceparent() -> str:
    context = trace.get_current_span().get_span_context()
    assert not context.trace_flags.sampled
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


async def headers_of_a_call(session: aiohttp.ClientSession) -> Any:
    """What a traced call of no headers of its own under the current context puts in its request's headers (no
    span: None returned)."""
    kwargs: _RequestOptions = {}
    call = Call(session, "POST", "http://127.0.0.1:1/v1/responses", kwargs, RetryPolicy(), server="m")
    assert call_span(call, "http://127.0.0.1:1") is None
    return kwargs["headers"]


async def test_a_dropped_rollouts_calls_share_one_read_only_headers_object_forgotten_when_it_ends(
    traced: Callable[..., Traced],
) -> None:
    made = traced(sampler=DROPPED)
    async with aiohttp.ClientSession() as session:
        with rollout_context("r-1", span=True):
            rollout = otel_context.get_current()
            first = await headers_of_a_call(session)
            assert await headers_of_a_call(session) is first
            assert isinstance(first, CIMultiDictProxy) and dict(first) == {"traceparent": expected_traceparent()}
            with pytest.raises(TypeError):
                first["traceparent"] = "changed"  # type: ignore[index]
            assert known_headers(rollout, propagate.get_global_textmap()) is first
        assert known_headers(rollout, propagate.get_global_textmap()) is None
        with rollout_context("r-2", span=True):
            second = await headers_of_a_call(session)
            assert second is not first and dict(second) == {"traceparent": expected_traceparent()}
    assert made.finished() == []


async def test_the_callers_headers_are_merged_into_a_copy_and_never_shared(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    traced(sampler=DROPPED)
    client = client_of(receiver.port)
    given = {"X-Caller": "kept", "TraceParent": f"00-{'1' * 32}-{'2' * 16}-01"}
    with rollout_context("r-1", span=True):
        assert await post(client, "/200") == 200
        assert await post(client, "/200", headers=given) == 200
        assert await post(client, "/200") == 200
        traceparent = expected_traceparent()
    plain, theirs, plain_again = receiver.requests
    assert theirs.headers["x-caller"] == "kept" and theirs.headers["traceparent"] == traceparent
    assert "x-caller" not in plain_again.headers  # the shared headers never took the caller's
    assert plain.headers["traceparent"] == plain_again.headers["traceparent"] == traceparent
    assert given == {"X-Caller": "kept", "TraceParent": f"00-{'1' * 32}-{'2' * 16}-01"}  # never touched


async def test_baggage_set_inside_a_dropped_rollout_goes_out_from_the_next_call(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    traced(sampler=DROPPED)
    client = client_of(receiver.port)
    with rollout_context("r-1", span=True):
        assert await post(client, "/200") == 200
        token = otel_context.attach(baggage.set_baggage("user", "u-1"))
        try:
            assert await post(client, "/200") == 200
        finally:
            otel_context.detach(token)
        assert await post(client, "/200") == 200
        traceparent = expected_traceparent()
    before, with_baggage, after = receiver.requests
    assert [request.headers.get("baggage") for request in receiver.requests] == [None, "user=u-1", None]
    assert before.headers["traceparent"] == with_baggage.headers["traceparent"] == after.headers["traceparent"]
    assert after.headers["traceparent"] == traceparent


async def test_a_propagator_set_inside_a_dropped_rollout_is_the_one_the_next_call_uses(
    traced: Callable[..., Traced], receiver: Receiver, client_of: Callable[[int], ServerClient]
) -> None:
    traced(sampler=DROPPED)
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
        traceparent = expected_traceparent()
    assert receiver.traceparents == [traceparent, None, traceparent]


async def test_at_most_max_contexts_are_kept(
    traced: Callable[..., Traced], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contexts that are no rollout's (the application's own unsampled spans) are never forgotten one by one."""
    traced(sampler=DROPPED)
    monkeypatch.setattr(_unsampled_headers, "MAX_CONTEXTS", 2)
    monkeypatch.setattr(_unsampled_headers, "_by_context", {})
    textmap = propagate.get_global_textmap()
    contexts = []
    async with aiohttp.ClientSession() as session:
        for number in range(3):
            parent = trace.NonRecordingSpan(trace.SpanContext(number + 1, number + 1, False))
            token = otel_context.attach(trace.set_span_in_context(parent))
            try:
                contexts.append(otel_context.get_current())
                await headers_of_a_call(session)
            finally:
                otel_context.detach(token)
    assert [known_headers(context, textmap) is not None for context in contexts] == [False, False, True]
