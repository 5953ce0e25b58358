"""What the tracing tests share: an SDK TracerProvider made gym_rpc's tracer for one test (never installed as the
global provider: the suite's other tests keep theirs), its finished spans, a loopback server noting the trace
headers and the client connection of every request it answers, and ServerClients calling it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from omegaconf import OmegaConf
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gym_rpc import telemetry
from gym_rpc.client.data import _call_spans as _http_tracing
from gym_rpc.client.data import _rollout
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig
from gym_rpc.telemetry import TRACER_NAME, TRACING
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port


@dataclass
class Traced:
    """A provider batching into an in-memory exporter; its tracer is gym_rpc's for the test."""

    provider: TracerProvider
    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)

    def __post_init__(self) -> None:
        self.processor = BatchSpanProcessor(self.exporter)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(TRACER_NAME, "test")

    def finished(self) -> list[ReadableSpan]:
        assert self.processor.force_flush(10_000)  # ours alone: another processor of the test's may say no
        return list(self.exporter.get_finished_spans())

    def clients(self) -> list[ReadableSpan]:
        return [span for span in self.finished() if span.kind is trace.SpanKind.CLIENT]


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Traced]]:
    """Make a `Traced` from a TracerProvider (or TracerProvider arguments) with gym_rpc's tracing on: its tracer
    makes the calls', the rollouts' and the receiving servers' spans."""
    made: list[Traced] = []
    monkeypatch.setattr(TRACING, "enabled", True)
    monkeypatch.setattr(TRACING, "decided", True)

    def make(provider: TracerProvider | None = None, **provider_arguments: Any) -> Traced:
        result = Traced(provider or TracerProvider(shutdown_on_exit=False, **provider_arguments))
        for module in (_http_tracing, _rollout, telemetry):
            monkeypatch.setattr(module, "tracer", lambda: result.tracer)
        made.append(result)
        return result

    yield make
    for result in made:
        result.provider.shutdown()


@dataclass
class Request:
    """What the receiver saw of one request."""

    headers: dict[str, str]
    client_port: int  # the client's end of the connection: equal ports, one pooled connection


@dataclass
class Receiver:
    """A loopback server answering /<status> with that status and `{}`, noting every request."""

    base_url: str
    port: int
    requests: list[Request]

    @property
    def traceparents(self) -> list[str | None]:
        return [request.headers.get("traceparent") for request in self.requests]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    requests: list[Request] = []

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        requests.append(Request({k.lower(): v for k, v in request.headers.items()}, peer[1] if peer else 0))
        return web.Response(status=int(request.match_info["status"]), text="{}")

    app = web.Application()
    app.router.add_route("*", "/{status:[0-9]+}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    port = int(runner.addresses[0][1])
    yield Receiver(f"http://{LOOPBACK}:{port}", port, requests)
    await runner.cleanup()


def client_for(port: int) -> ServerClient:
    """A ServerClient whose "policy_model" is on `port`, resending once after 10 ms."""
    doc = document(
        {"policy_model": server_entry(port)},
        http_client={"retry": {"attempts": 2, "initial_backoff_seconds": 0.01, "max_backoff_seconds": 0.01}},
    )
    head = BaseServerConfig(host=LOOPBACK, port=closed_port())
    return ServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))


@pytest.fixture
async def client_of() -> AsyncIterator[Callable[[int], ServerClient]]:
    """`client_for`, each client closed after the test."""
    made: list[ServerClient] = []

    def make(port: int) -> ServerClient:
        made.append(client_for(port))
        return made[-1]

    yield make
    for client in made:
        await client.aclose()


async def post(client: ServerClient, path: str, headers: dict[str, str] | None = None) -> int:
    response = await client.post("policy_model", path, json={}, headers=headers)
    async with response:
        await response.read()
    return response.status


class WritesNothing(TraceContextTextMapPropagator):
    """A propagator of its own (not the default one) that carries nothing."""

    def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
        pass
