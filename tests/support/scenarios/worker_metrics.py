"""Run by tests/client/data/test_worker_metrics.py in a fresh interpreter (the MeterProvider is set once per
process): a ServerClient posts to real loopback servers, one that answers, one that drops the first connection, and
a closed port; prints the metrics an in-memory reader collected, as JSON.

`python tests/support/scenarios/worker_metrics.py app` installs the application's MeterProvider and calls
`enable_client_metrics()`; `env` relies on OTEL_METRICS_EXPORTER (the test sets it), so gym_rpc installs the
provider; `off` installs a provider but never enables client metrics; `prometheus` exposes them through
prometheus_client and reports the names a scrape shows; `app-traced` is `app` with the SDK's TracerProvider and
tracing on, and reports the CLIENT spans too. The result is the line starting "RESULT "
(an exporter may print to stdout too).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from typing import Any

from tests.support.servers import start_dropping_server, start_ok_server

LOOPBACK = "127.0.0.1"
OK_CALLS = 5


def collected(reader: Any) -> dict[str, list[dict[str, Any]]]:
    """name -> data points (attributes, and value or count/sum) of everything the reader holds."""
    found: dict[str, list[dict[str, Any]]] = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else ():
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in metric.data.data_points:
                    entry: dict[str, Any] = {"attributes": dict(point.attributes or {})}
                    if hasattr(point, "count"):
                        entry["count"] = point.count
                    else:
                        entry["value"] = point.value
                    found.setdefault(metric.name, []).append(entry)
    return found


async def main(mode: str) -> None:
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    if mode in ("app", "app-traced", "off"):
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    spans = None
    if mode == "app-traced":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
        trace.set_tracer_provider(tracer_provider)
    if mode == "prometheus":  # an application exposing its metrics to Prometheus
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))

    ok_runner, ok_port = await start_ok_server()
    dropping, dropping_port, _ = await start_dropping_server(1)
    closed = socket.socket()
    closed.bind((LOOPBACK, 0))  # bound, never listening: refused for the whole scenario
    document = {
        "head_server": {"host": LOOPBACK, "port": 1},
        "ok": {"responses_api_models": {"impl": {"host": LOOPBACK, "port": ok_port}}},
        "flaky": {"responses_api_models": {"impl": {"host": LOOPBACK, "port": dropping_port}}},
        "gone": {"resources_servers": {"impl": {"host": LOOPBACK, "port": closed.getsockname()[1]}}},
        "http_client": {"retry": {"attempts": 3, "initial_backoff_seconds": 0.01}},
    }
    if mode == "app-traced":
        document["observability_enabled"] = True  # gym_rpc traces its calls
    if (
        mode == "prometheus"
    ):  # a replicated server too: the per-instance series (picks, ejections) the dashboard shows
        replicas = [f"{LOOPBACK}:{closed.getsockname()[1]}"]
        document["replicated"] = {
            "responses_api_models": {"impl": {"host": LOOPBACK, "port": ok_port, "replicas": replicas}}
        }
    if mode == "gym-block":  # NeMo Gym's own switch in the config, the environment silent
        document["telemetry"] = {"enabled": True, "traces_enabled": False, "exporter": "console"}
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps(document)

    from gym_rpc.client.server_client import ServerClient
    from gym_rpc.errors import ServerUnreachableError
    from gym_rpc.metrics import METRICS, enable_client_metrics

    if mode in ("app", "app-traced", "prometheus"):
        enable_client_metrics()
    client = ServerClient.load_from_global_config()
    enabled = METRICS.enabled
    for _ in range(OK_CALLS):
        async with await client.post("ok", "/v1/responses", json={"input": "hi"}) as response:
            await response.read()
    async with await client.post("flaky", "/verify", json={}) as response:
        await response.read()
    if mode == "prometheus":
        for _ in range(OK_CALLS):
            async with await client.post("replicated", "/v1/responses", json={"input": "hi"}) as response:
                await response.read()
    unreachable = False
    try:
        await client.post("gone", "/verify", json={})
    except ServerUnreachableError:
        unreachable = True
    await client.aclose()
    await ok_runner.cleanup()
    dropping.close()
    closed.close()
    result = {
        "enabled": enabled,
        "provider": type(metrics.get_meter_provider()).__module__,
        "unreachable_raised": unreachable,
        "metrics": collected(reader) if mode in ("app", "app-traced", "off") else {},
        "spans": None if spans is None else [dict(span.attributes or {}) for span in spans.get_finished_spans()],
    }
    if mode == "prometheus":
        import prometheus_client
        from prometheus_client.parser import text_string_to_metric_families

        text = prometheus_client.generate_latest().decode()
        families = text_string_to_metric_families(text)
        result["exposed"] = sorted({sample.name for family in families for sample in family.samples})
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
