"""Run by tests/client/tracing/test_tracing_fit.py in fresh interpreters (tracing is decided once per process): how
gym_rpc's tracing fits the OpenTelemetry set-ups NeMo Gym users run. Each mode prints one JSON line of finished
spans.

* `aiohttp-instrumented`: the application turned on opentelemetry-instrumentation-aiohttp-client; ServerClient
  posts (one call resent once): its spans are the CLIENT spans, carrying gym_rpc's attributes.
* `rollout-span`: two rollouts under `rollout_context(id, span=True)`, each a model call and a /verify.
* `probes`: a head probing a traced aiohttp server (TraceContextPathMiddleware) for a while, the aiohttp client
  instrumentation on too: no span at all may come of it.
* `sampled-rollouts`: a parent-based sampler that keeps only rollout "keep"; rollouts "keep" and "drop" each post
  twice to a server that notes the `traceparent` it gets.
* `first-fetch`: `ServerClient.load_from_global_config()` from the head at $GYM_RPC_HEAD, whose config turns
  tracing on: the fetch itself is a span.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from aiohttp import web

from tests.support.scenarios.telemetry import install_app_provider, span_json
from tests.support.servers import start_dropping_server, start_ok_server

LOOPBACK = "127.0.0.1"


async def start_server(*, middleware: bool = False) -> tuple[web.AppRunner, int]:
    from gym_rpc.integrations import TraceContextPathMiddleware

    return await start_ok_server(setup=TraceContextPathMiddleware.install if middleware else None)


def inject_config(servers: dict[str, Any]) -> None:
    document = {"head_server": {"host": LOOPBACK, "port": 1}, "observability_enabled": True, **servers}
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps(document)


def entry(port: int, server_type: str = "responses_api_models") -> dict[str, Any]:
    return {server_type: {"impl": {"host": LOOPBACK, "port": port}}}


async def aiohttp_instrumented(exporter: Any) -> dict[str, Any]:
    from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor

    AioHttpClientInstrumentor().instrument()
    runner, port = await start_server()
    dropping, dropping_port, _ = await start_dropping_server(1)
    inject_config({"policy_model": entry(port), "judge": entry(dropping_port, "resources_servers")})
    from gym_rpc.client import ServerClient, rollout_context

    client = ServerClient.load_from_global_config()
    with rollout_context("r-1"):
        async with await client.post("policy_model", "/v1/responses", json={"input": "hi"}) as response:
            await response.read()
        async with await client.post("judge", "/verify", json={}) as response:
            await response.read()
    await client.aclose()
    await runner.cleanup()
    dropping.close()
    return {"spans": [span_json(s) for s in exporter.get_finished_spans()]}


async def rollout_span(exporter: Any) -> dict[str, Any]:
    model_runner, model_port = await start_server()
    judge_runner, judge_port = await start_server()
    inject_config({"policy_model": entry(model_port), "judge": entry(judge_port, "resources_servers")})
    from gym_rpc.client import ServerClient, rollout_context

    client = ServerClient.load_from_global_config()

    async def one_rollout(rollout_id: str) -> None:
        with rollout_context(rollout_id, span=True):
            async with await client.post("policy_model", "/v1/responses", json={"input": "hi"}) as response:
                await response.read()
            async with await client.post("judge", "/verify", json={}) as response:
                await response.read()

    await asyncio.gather(one_rollout("r-a"), one_rollout("r-b"))
    await client.aclose()
    await model_runner.cleanup()
    await judge_runner.cleanup()
    return {"spans": [span_json(s) for s in exporter.get_finished_spans()]}


async def probes(exporter: Any) -> dict[str, Any]:
    from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor

    from gym_rpc.config import GlobalConfig
    from gym_rpc.server import HeadOptions, HeadServer
    from gym_rpc.telemetry import TRACING

    AioHttpClientInstrumentor().instrument()
    runner, port = await start_server(middleware=True)
    document = {"head_server": {"host": LOOPBACK, "port": 0}, "observability_enabled": True, "probed": entry(port)}
    head = HeadServer(GlobalConfig.from_document(document), HeadOptions(port=0, probe_interval_seconds=0.05))
    await head.start()
    for _ in range(200):  # bounded: 10 s for at least 5 rounds
        if head.prober.report("probed").status == "success":
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # several more rounds
    status = head.prober.report("probed").status
    await head.stop()
    await runner.cleanup()
    return {
        "tracing": TRACING.enabled,
        "status": status,
        "spans": [span_json(s) for s in exporter.get_finished_spans()],
    }


def keep_one_rollout_sampler() -> Any:
    """A parent-based sampler whose root keeps the rollout span with gym.rollout_id "keep", nothing else."""
    from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult

    class KeepOneRollout(Sampler):
        def should_sample(self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any) -> Any:
            attributes = kwargs.get("attributes") or (args[1] if len(args) > 1 else None) or {}
            keep = attributes.get("gym.rollout_id") == "keep"
            return SamplingResult(Decision.RECORD_AND_SAMPLE if keep else Decision.DROP, attributes)

        def get_description(self) -> str:
            return "KeepOneRollout"

    return ParentBased(KeepOneRollout())


async def sampled_rollouts(exporter: Any) -> dict[str, Any]:
    from opentelemetry import trace

    received: list[str | None] = []

    async def note(request: web.Request) -> web.Response:
        await request.read()
        received.append(request.headers.get("traceparent"))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", note)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    inject_config({"policy_model": entry(int(runner.addresses[0][1]))})
    from gym_rpc.client import ServerClient, rollout_context

    client = ServerClient.load_from_global_config()
    rollouts = {}
    for rollout_id in ("keep", "drop"):
        with rollout_context(rollout_id, span=True):
            context = trace.get_current_span().get_span_context()
            rollouts[rollout_id] = {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}
            for _ in range(2):
                async with await client.post("policy_model", "/v1/responses", json={}) as response:
                    await response.read()
    await client.aclose()
    await runner.cleanup()
    spans = [span_json(s) for s in exporter.get_finished_spans()]
    return {"rollouts": rollouts, "received": received, "spans": spans}


async def first_fetch(exporter: Any) -> dict[str, Any]:
    from gym_rpc.client import ServerClient
    from gym_rpc.telemetry import TRACING

    client = await asyncio.to_thread(ServerClient.load_from_global_config)
    return {
        "tracing": TRACING.enabled,
        "observability": client.global_config_dict["observability_enabled"],
        "spans": [span_json(s) for s in exporter.get_finished_spans()],
    }


MODES = {
    "aiohttp-instrumented": aiohttp_instrumented,
    "rollout-span": rollout_span,
    "probes": probes,
    "first-fetch": first_fetch,
    "sampled-rollouts": sampled_rollouts,
}
SAMPLERS = {"sampled-rollouts": keep_one_rollout_sampler}


async def main(mode: str) -> None:
    sampler = SAMPLERS.get(mode)
    exporter = install_app_provider(sampler() if sampler is not None else None)
    result = await MODES[mode](exporter)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
