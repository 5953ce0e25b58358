"""Run by tests/client/replicas/test_replicas_client.py in a fresh interpreter (the MeterProvider is set once per
process): a ServerClient of an injected config with three static replicas of one server, one of them refusing,
makes calls of no rollout and of rollouts; prints the per-instance worker metrics an in-memory reader collected, as
JSON on the line starting "RESULT ". `python tests/support/scenarios/replicas_metrics.py traced` traces the calls
too (the SDK's TracerProvider, observability on), and reports the CLIENT spans.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from typing import Any

from tests.support.scenarios.worker_metrics import collected
from tests.support.servers import start_ok_server

LOOPBACK = "127.0.0.1"
CALLS = 30
MAX_UNPINNED_CALLS = 300


def _ejected(reader: Any, port: int) -> bool:
    """Whether the worker metrics count an ejection of the instance at `port`."""
    return any(
        point["value"] > 0 and point["attributes"]["gym.server.instance.id"].endswith(f":{port}")
        for point in collected(reader).get("gym.client.instance.ejections", ())
    )


async def main(traced: bool) -> None:
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    spans = None
    if traced:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        trace.set_tracer_provider(tracer_provider)
    first, first_port = await start_ok_server()
    second, second_port = await start_ok_server()
    closed = socket.socket()
    closed.bind((LOOPBACK, 0))  # bound, never listening: refused for the whole scenario
    refused_port = closed.getsockname()[1]
    replicas = [f"{LOOPBACK}:{second_port}", f"{LOOPBACK}:{refused_port}"]
    entry = {"host": LOOPBACK, "port": first_port, "replicas": replicas}
    document = {
        "head_server": {"host": LOOPBACK, "port": 1},
        "policy": {"responses_api_models": {"impl": entry}},
        "http_client": {"retry": {"attempts": 3, "initial_backoff_seconds": 0.001}},
        "observability_enabled": traced,
    }
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps(document)

    from gym_rpc.client import rollout_context
    from gym_rpc.client.server_client import ServerClient
    from gym_rpc.metrics import enable_client_metrics

    enable_client_metrics()
    client = ServerClient.load_from_global_config()
    # Calls of no rollout until the refused instance is ejected (two random choices reach it about one call in
    # three, so 30 calls alone left it unejected now and then): no rollout may then be pinned to it.
    unpinned = 0
    while unpinned < CALLS or not _ejected(reader, refused_port):
        assert unpinned < MAX_UNPINNED_CALLS, "the refused instance was never ejected"
        async with await client.post("policy", "/v1/responses", json={}) as response:
            await response.read()
        unpinned += 1
    for n in range(CALLS):
        with rollout_context(f"rollout-{n}"):
            async with await client.post("policy", "/v1/responses", json={}) as response:
                await response.read()
    await client.aclose()
    await first.cleanup()
    await second.cleanup()
    closed.close()
    ports = {"first": first_port, "second": second_port, "refused": refused_port}
    calls = {"unpinned": unpinned, "rollouts": CALLS}
    finished = [] if spans is None else [dict(span.attributes or {}) for span in spans.get_finished_spans()]
    print(
        "RESULT " + json.dumps({"ports": ports, "calls": calls, "metrics": collected(reader), "spans": finished}),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:] == ["traced"]))
