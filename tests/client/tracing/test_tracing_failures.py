"""Tracing and metrics can never fail a call: whatever a span processor, a sampler, an SDK whose spans cannot end,
or the worker metrics' instruments raise, at a call's start or at its end, the caller gets its response (or the
call's own error), the connection goes back to the pool, and the failure is logged once per interval. Real SDK
parts that raise, real aiohttp servers on loopback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.metrics import ExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult

from gym_rpc import telemetry
from gym_rpc.client import rollout_context
from gym_rpc.client.data import _call_metrics as client_metrics
from gym_rpc.client.data._http import Call, send
from gym_rpc.client.resend._policy import RetryPolicy
from gym_rpc.client.server_client import ServerClient
from gym_rpc.errors import ServerUnreachableError
from gym_rpc.integrations import TraceContextPathMiddleware
from gym_rpc.metrics import METRICS
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.tracing import Receiver, Traced

CALLS = 5


class FailsOnStart(SpanProcessor):
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("a processor that fails on start")


class FailsOnEnd(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("a processor (or its exporter) that fails on end")


class FailingSampler(Sampler):
    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        raise ValueError("a sampler that fails")

    def get_description(self) -> str:
        return "FailingSampler"


class EndlessSpan(trace.Span):
    """An SDK span, but one that cannot end, as an SDK upgrade that changed `ReadableSpan` would make it."""

    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def end(self, end_time: int | None = None) -> None:
        raise TypeError("ReadableSpan.__init__() takes from 1 to 13 positional arguments but 14 were given")

    def get_span_context(self) -> trace.SpanContext:
        return self.span.get_span_context()

    def set_attributes(self, attributes: Any) -> None:
        self.span.set_attributes(attributes)

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        self.span.add_event(name, attributes, timestamp)

    def update_name(self, name: str) -> None:
        self.span.update_name(name)

    def is_recording(self) -> bool:
        return self.span.is_recording()

    def set_status(self, status: Any, description: str | None = None) -> None:
        self.span.set_status(status, description)

    def record_exception(self, exception: BaseException, *args: Any, **kwargs: Any) -> None:
        self.span.record_exception(exception, *args, **kwargs)


class IncompatibleTracer(trace.Tracer):
    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return EndlessSpan(self.tracer.start_span(*args, **kwargs))

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class IncompatibleSdk(TracerProvider):
    """The SDK's provider, whose spans raise when they end."""

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return IncompatibleTracer(super().get_tracer(*args, **kwargs))


def failing_provider(how: str) -> TracerProvider:
    if how == "sampler":
        return TracerProvider(sampler=FailingSampler(), shutdown_on_exit=False)
    if how == "incompatible sdk":
        return IncompatibleSdk(shutdown_on_exit=False)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(FailsOnStart() if how == "on_start" else FailsOnEnd())
    return provider


FAILURES = ["on_start", "on_end", "sampler", "incompatible sdk"]


@pytest.fixture
def failure_log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Callable[[str], list[str]]:
    """The lines logged about `kind` failures, with a fresh hour-long interval (so a slow machine cannot make it
    two)."""
    monkeypatch.setattr(telemetry, "_failure_logs", {})
    monkeypatch.setattr(telemetry, "FAILURE_LOG_INTERVAL_SECONDS", 3600.0)
    caplog.set_level(logging.WARNING, logger=telemetry.logger.name)

    def lines(kind: str) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == telemetry.logger.name and r.getMessage().startswith(kind)
        ]

    return lines


async def calls_answered(client: ServerClient, calls: int = CALLS, *, rollout_span: bool = True) -> list[bytes]:
    """`calls` posts, one after another, in one rollout; each answer's body."""
    bodies = []
    with rollout_context("r-1", span=rollout_span):
        for _ in range(calls):
            async with await client.post("policy_model", "/200", json={}) as response:
                assert response.status == 200
                bodies.append(await response.read())
    return bodies


def one_pooled_connection(receiver: Receiver) -> bool:
    """Whether every request came over one connection: each call gave its connection back to the pool."""
    return len({request.client_port for request in receiver.requests}) == 1


@pytest.mark.parametrize("how", FAILURES)
async def test_a_failing_tracer_never_fails_a_call(
    traced: Callable[..., Traced],
    receiver: Receiver,
    client_of: Callable[[int], ServerClient],
    failure_log: Callable[[str], list[str]],
    how: str,
) -> None:
    traced(failing_provider(how))
    assert await calls_answered(client_of(receiver.port)) == [b"{}"] * CALLS
    assert one_pooled_connection(receiver) and len(receiver.requests) == CALLS
    assert len(failure_log("tracing")) == 1  # once per interval, however many calls it failed


@pytest.mark.parametrize("how", FAILURES)
async def test_a_failed_call_raises_its_own_error_whatever_the_tracer_raises(
    traced: Callable[..., Traced], client_of: Callable[[int], ServerClient], how: str
) -> None:
    traced(failing_provider(how))
    with pytest.raises(ServerUnreachableError), rollout_context("r-1", span=True):
        await client_of(closed_port()).post("policy_model", "/200", json={})


class FailingExemplarFilter(ExemplarFilter):
    """Asked by the SDK on every measurement: here every instrument of the provider fails on each one."""

    def should_sample(self, *args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("an instrument that fails")


def raising_instruments() -> client_metrics._ClientInstruments:
    """The worker metrics' instruments from an SDK MeterProvider whose every measurement raises."""
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], exemplar_filter=FailingExemplarFilter())
    meter = provider.get_meter("gym_rpc.tests")
    return client_metrics._ClientInstruments(
        duration=meter.create_histogram("http.client.request.duration", unit="s"),
        resends=meter.create_counter("gym.client.resends"),
        given_up=meter.create_counter("gym.client.given_up"),
        unreachable=meter.create_counter("gym.client.unreachable"),
    )


@pytest.mark.parametrize("tracing", [False, True], ids=["metrics only", "and a tracer failing on end"])
async def test_failing_worker_metrics_never_fail_a_call(
    monkeypatch: pytest.MonkeyPatch,
    traced: Callable[..., Traced],
    receiver: Receiver,
    client_of: Callable[[int], ServerClient],
    failure_log: Callable[[str], list[str]],
    tracing: bool,
) -> None:
    instruments = raising_instruments()
    with pytest.raises(RuntimeError, match="an instrument that fails"):
        instruments.duration.record(1.0)  # the double fails as the test says
    monkeypatch.setattr(client_metrics, "_instruments", lambda: instruments)
    monkeypatch.setattr(METRICS, "enabled", True)
    made = traced() if tracing else None
    if made is not None:
        made.provider.add_span_processor(FailsOnEnd())  # after the exporter's: the span reaches it, then fails
    else:
        monkeypatch.setattr(telemetry.TRACING, "enabled", False)
    assert await calls_answered(client_of(receiver.port)) == [b"{}"] * CALLS
    assert one_pooled_connection(receiver)
    assert len(failure_log("metrics")) == 1
    assert len(failure_log("tracing")) == (1 if tracing else 0)  # each kind its own line
    assert made is None or len(made.clients()) == CALLS  # the span still ended after the metrics failed
    assert set(client_metrics._in_flight.values()) <= {0}  # every call counted out


async def test_worker_metrics_that_cannot_start_leave_the_call_unmetered(
    monkeypatch: pytest.MonkeyPatch,
    receiver: Receiver,
    client_of: Callable[[int], ServerClient],
    failure_log: Callable[[str], list[str]],
) -> None:
    def cannot_make_instruments() -> client_metrics._ClientInstruments:
        raise RuntimeError("no instrument can be made")

    monkeypatch.setattr(client_metrics, "_instruments", cannot_make_instruments)
    monkeypatch.setattr(METRICS, "enabled", True)
    monkeypatch.setattr(telemetry.TRACING, "enabled", False)
    assert await calls_answered(client_of(receiver.port), rollout_span=False) == [b"{}"] * CALLS
    assert one_pooled_connection(receiver) and len(failure_log("metrics")) == 1


class CancelledAtTheAnswer:
    """An observer that raises a BaseException (here a cancellation) when told of the answer."""

    kind = "tracing"

    def __init__(self) -> None:
        self.responses: list[aiohttp.ClientResponse] = []

    def resent(self, attempt: int, kind: str) -> None:
        pass

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        self.responses.append(response)
        raise asyncio.CancelledError

    def failed(self, error: BaseException, attempts: int) -> None:
        pass


async def test_an_observer_that_raises_a_base_exception_leaves_no_response_unreleased(receiver: Receiver) -> None:
    observer = CancelledAtTheAnswer()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.CancelledError):
            await send(
                Call(
                    session,
                    "POST",
                    receiver.base_url + "/200",
                    {},
                    RetryPolicy(attempts=1),
                    resend=True,
                    observer=observer,
                )
            )
    [response] = observer.responses
    assert response.closed


def middleware_app() -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"rollout": request.get("rollout_id")})

    app = TraceContextPathMiddleware.install(web.Application())
    app.router.add_post("/verify", answer)
    return app


@pytest.mark.parametrize("how", FAILURES)
async def test_a_failing_tracer_never_fails_a_request_a_traced_server_answers(
    traced: Callable[..., Traced],
    http_server: Callable[..., Any],
    failure_log: Callable[[str], list[str]],
    how: str,
) -> None:
    traced(failing_provider(how))
    port = await http_server(middleware_app())
    async with aiohttp.ClientSession() as session:
        for _ in range(CALLS):
            async with session.post(f"http://{LOOPBACK}:{port}/ng-rollout/r-1/verify") as response:
                assert (response.status, await response.json()) == (200, {"rollout": "r-1"})
    assert len(failure_log("tracing")) == 1


def test_the_first_config_fetchs_span_may_fail_the_client_may_not(
    traced: Callable[..., Traced], failure_log: Callable[[str], list[str]]
) -> None:
    from gym_rpc.client.tracing import _grpc_interceptors as client_tracing

    traced(failing_provider("on_end"))
    client_tracing.record_config_fetch_span(f"{LOOPBACK}:1", 1, 2)
    assert len(failure_log("tracing")) == 1
