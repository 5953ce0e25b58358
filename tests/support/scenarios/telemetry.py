"""One worker's rollout through real parts, run in a fresh process so that each scenario gets its own global
TracerProvider and its own tracing decision (`python tests/support/scenarios/telemetry.py SCENARIO`, used by
tests/client/tracing/test_telemetry.py). Prints one JSON object: the spans recorded, what the receiving servers
saw, and which OpenTelemetry modules got imported.

Scenarios (the environment, set by the caller, decides the OTEL_* variables):
* `app-provider`: the application installs an SDK provider with an in-memory exporter before anything else.
* `bare`: nobody installs a provider (tracing must then stay free: no SDK import).
* `otlp`: nobody installs one; OTEL_EXPORTER_OTLP_ENDPOINT is set, so gym_rpc installs the SDK's with OTLP.
Config flag: `--observability` puts `observability_enabled: true` in the global config. `--rules` adds the calls
whose tracing rules README states: a status watch and a health check inside the worker's span, a health check
outside any span (as a Kubernetes probe makes), and a server without the middleware that uses `server_span()`.

The servers start before the worker's span exists, so nothing but the wire (gRPC metadata, the `traceparent`
header, the `/ng-trace/` path segment) can carry the worker's trace to them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import aiohttp
import grpc
import uvicorn
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from gym_rpc.client.control._channel import close_aio_channels, close_sync_channels
from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.data._rollout import apply_rollout_prefix, current_rollout_id, rollout_context
from gym_rpc.client.server_client import ServerClient
from gym_rpc.client.tracing._grpc_interceptors import aio_client_interceptors
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.integrations._middleware import Receive, Scope, Send, TraceContextPathMiddleware
from gym_rpc.server._head import HeadOptions, HeadServer
from gym_rpc.server.observability._grpc_tracing import server_interceptors
from gym_rpc.telemetry import server_span, set_response_status, tracing_enabled

LOOPBACK = "127.0.0.1"
ROLLOUT_ID = "rollout-7"
# The tracing SDK, not the metrics one: the head in these scenarios always measures (gym_rpc.metrics).
WATCHED_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.instrumentation.grpc", "opentelemetry.propagate")


def seen_by_handler(traceparent: str | None) -> dict[str, Any]:
    """What a receiving handler observes: the header, the span it runs in, the rollout id bound for it."""
    context = trace.get_current_span().get_span_context()
    return {
        "traceparent": traceparent,
        "current_span_id": f"{context.span_id:016x}" if context.is_valid else None,
        "rollout_id": current_rollout_id(),
    }


async def aiohttp_responses(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response(seen_by_handler(request.headers.get("traceparent")))


async def aiohttp_failing(request: web.Request) -> web.Response:
    return web.Response(status=500, text="model crashed")


async def asgi_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":  # lifespan
        message = await receive()
        await send({"type": f"{message['type']}.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    headers = {name.decode().lower(): value.decode() for name, value in scope["headers"]}
    body = json.dumps(seen_by_handler(headers.get("traceparent"))).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def start_aiohttp_receiver() -> tuple[web.AppRunner, int]:
    app = TraceContextPathMiddleware.install(web.Application())
    app.router.add_post("/v1/responses", aiohttp_responses)
    app.router.add_post("/fail", aiohttp_failing)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    return runner, int(runner.addresses[0][1])


async def start_asgi_receiver() -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    config = uvicorn.Config(
        TraceContextPathMiddleware(asgi_app), host=LOOPBACK, port=0, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(500):  # bounded: 5 s
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started, "uvicorn did not start"
    return server, task, int(server.servers[0].sockets[0].getsockname()[1])


async def plain_handler(request: web.Request) -> web.Response:
    """A server without TraceContextPathMiddleware that continues the caller's trace with server_span()."""
    with server_span(
        request.method, request.headers, path=request.path, scheme=request.scheme, rollout_id=None
    ) as span:
        response = web.json_response(seen_by_handler(request.headers.get("traceparent")))
        set_response_status(span, response.status, server=True)
        return response


async def start_plain_receiver() -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_post("/{tail:.*}", plain_handler)  # rollout prefixes stay in the path: no middleware
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    return runner, int(runner.addresses[0][1])


async def health_check(address: str, traced: bool) -> int:
    """One grpc.health.v1 Check of the head, through gym_rpc's traced channel interceptors or a bare channel."""
    interceptors = aio_client_interceptors() if traced else None
    async with grpc.aio.insecure_channel(address, interceptors=interceptors) as channel:
        answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(answer.status)


def install_app_provider(sampler: Any = None) -> Any:
    """What an application does before using gym_rpc: its own SDK provider (the SDK's default sampler unless
    given), here with an in-memory exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def span_json(span: Any) -> dict[str, Any]:
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
        "status": span.status.status_code.name,
    }


async def post_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.post(url, json={"input": "hi"}) as response:
        assert response.status == 200, (url, response.status, await response.text())
        answer: dict[str, Any] = await response.json()
        return answer


async def run(scenario: str, observability: bool, rules: bool) -> dict[str, Any]:
    exporter = install_app_provider() if scenario == "app-provider" else None
    runner, aiohttp_port = await start_aiohttp_receiver()
    plain_runner, plain_port = await start_plain_receiver()
    uvicorn_server, uvicorn_task, asgi_port = await start_asgi_receiver()
    doc: dict[str, Any] = {
        "head_server": {"host": LOOPBACK, "port": 0},
        "policy": {"responses_api_models": {"aiohttp_model": {"host": LOOPBACK, "port": aiohttp_port}}},
        "judge": {"responses_api_models": {"asgi_model": {"host": LOOPBACK, "port": asgi_port}}},
        "observability_enabled": observability,
    }
    if rules:
        doc["plain"] = {"responses_api_models": {"plain_model": {"host": LOOPBACK, "port": plain_port}}}
    head = HeadServer(GlobalConfig.from_document(doc), HeadOptions(port=0, probe_interval_seconds=0.1))
    await head.start()
    result: dict[str, Any] = {"tracing_enabled": tracing_enabled()}
    tracer = trace.get_tracer("worker")
    try:
        with tracer.start_as_current_span("rollout-worker") as worker, rollout_context(ROLLOUT_ID):
            result["worker_span_id"] = f"{worker.get_span_context().span_id:016x}"
            head_config = BaseServerConfig(host=LOOPBACK, port=head.port)
            client = await asyncio.to_thread(ServerClient.load_from_global_config, head_config)  # sync channel
            result["sync_status"] = await asyncio.to_thread(client.poll_for_status, "policy")  # sync channel
            report = await ControlClient(head.address).get_server_status("judge")  # grpc.aio channel
            result["aio_status"] = report.status
            result["header"] = {}
            for name in ("policy", "judge"):
                async with await client.post(name, "/v1/responses", json={"input": "hi"}) as response:
                    assert response.status == 200, await response.text()
                    result["header"][name] = await response.json()
            async with await client.post("policy", "/fail") as response:
                result["fail_status"] = response.status
            if rules:
                async for event in ControlClient(head.address).watch_server_statuses():
                    result["watch_kind"] = event.kind
                    break
                result["traced_health"] = await health_check(head.address, traced=True)
                async with await client.post("plain", "/v1/responses", json={"input": "hi"}) as response:
                    assert response.status == 200, await response.text()
                    result["header"]["plain"] = await response.json()
            with tracer.start_as_current_span("hand-off") as hand_off:
                result["hand_off_span_id"] = f"{hand_off.get_span_context().span_id:016x}"
                handed = {
                    name: apply_rollout_prefix(f"http://{LOOPBACK}:{port}", ROLLOUT_ID)
                    for name, port in (("policy", aiohttp_port), ("judge", asgi_port))
                }
        result["handed_urls"] = handed
        if rules:  # outside any span, without interceptors: as a Kubernetes probe asks
            result["probe_health"] = await health_check(head.address, traced=False)
        # A client Gym does not instrument, outside any span: only the URL carries the trace.
        async with aiohttp.ClientSession() as plain:
            result["path"] = {name: await post_json(plain, url + "/v1/responses") for name, url in handed.items()}
        result["interceptors"] = {
            "aio_client": len(aio_client_interceptors()),
            "server": len(server_interceptors()),
        }
        await client.aclose()
    finally:
        await close_aio_channels()
        close_sync_channels()
        await head.stop()
        await runner.cleanup()
        await plain_runner.cleanup()
        uvicorn_server.should_exit = True
        await asyncio.wait_for(uvicorn_task, 5)
    result["modules"] = {name: name in sys.modules for name in WATCHED_MODULES}
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()  # flushes a batching exporter (the OTLP scenario)
    result["spans"] = [span_json(span) for span in exporter.get_finished_spans()] if exporter is not None else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["app-provider", "bare", "otlp"])
    parser.add_argument("--observability", action="store_true")
    parser.add_argument("--rules", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.scenario, args.observability, args.rules))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
