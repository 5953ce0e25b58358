"""Tracing: one OpenTelemetry trace from a worker's span through the head's RPCs, the data-plane calls and the
receiving servers, and nothing at all when tracing is off.

OpenTelemetry allows one global TracerProvider per process and the tracing decision is per process too, so every
traced scenario runs in a fresh interpreter (tests/support/scenarios/telemetry.py) that prints its finished spans
as JSON; the pure decision rule and the untraced hot path are checked here in-process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gym_rpc._telemetry_switches import effective_environment
from gym_rpc.client.data._rollout import trace_context_path_segment
from gym_rpc.telemetry import decide_tracing, environment_choice
from tests.support.loopback import LOOPBACK
from tests.support.scenarios import script

SCENARIO = script("telemetry")
ROLLOUT_ID = "rollout-7"
CONTROL_SERVICE = "gym_rpc.v1.ControlPlaneService"
# A hang guard: a scenario takes 2-4 s at a load average of 10 and 7-16 s at 30-50 (where 30 s was once passed).
SCENARIO_TIMEOUT_SECONDS = 90


def scenario_environment(**otel: str) -> dict[str, str]:
    """This process's environment without any OTEL_* (or NeMo Gym telemetry) variable, plus the given ones."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_OTEL_", "NEMO_LENS_"))}
    env.update(otel)
    return env


def run_scenario(*args: str, **otel: str) -> dict[str, Any]:
    return run_json([sys.executable, str(SCENARIO), *args], **otel)


def run_json(command: list[str], **otel: str) -> dict[str, Any]:
    """Run a traced scenario in a fresh interpreter (tracing is decided once per process) and read its JSON."""
    python, *rest = command
    process = subprocess.Popen(
        [python, "-X", "faulthandler", *rest],
        env=scenario_environment(**otel),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=SCENARIO_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to stderr, then it ends
        stdout, stderr = process.communicate(timeout=10)
        raise AssertionError(f"{rest} ran past {SCENARIO_TIMEOUT_SECONDS} s; its stacks:\n{stderr}") from None
    assert process.returncode == 0, stderr
    result: dict[str, Any] = json.loads(stdout)
    return result


def only(spans: list[dict[str, Any]], **expected: Any) -> dict[str, Any]:
    """The single span whose fields (or, for dotted keys, attributes) have these values."""

    def matches(span: dict[str, Any]) -> bool:
        return all(
            (span["attributes"].get(key) if "." in key else span.get(key)) == value
            for key, value in expected.items()
        )

    found = [span for span in spans if matches(span)]
    assert len(found) == 1, f"{len(found)} spans match {expected}: {[s['name'] for s in spans]}"
    return found[0]


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [span for span in spans if span["parent_id"] == parent["span_id"]]


# --- the decision rule (pure) ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "observability_enabled", "application_provider", "expected"),
    [
        ({}, False, False, False),
        ({}, False, True, False),
        ({}, True, False, False),  # prefixes only: no spans made that nothing would export
        ({}, True, True, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False, False, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, False, False, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, False, False, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, True, True, False),
        ({"OTEL_SDK_DISABLED": "true"}, True, True, False),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True, True, False),
        ({"OTEL_SDK_DISABLED": "false"}, True, True, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False, False, False),
    ],
)
def test_decision_rule(
    environ: dict[str, str], observability_enabled: bool, application_provider: bool, expected: bool
) -> None:
    assert decide_tracing(environ, observability_enabled, application_provider) is expected


GYM_ON = {"NEMO_GYM_OTEL_ENABLED": "1"}


@pytest.mark.parametrize(
    ("environ", "block", "observability_enabled", "application_provider", "expected"),
    [
        (GYM_ON, None, False, False, True),
        ({"NEMO_LENS_ENABLED": "yes"}, None, False, False, True),  # the nemo-lens spelling, read second
        ({"NEMO_GYM_OTEL_ENABLED": "0", "NEMO_LENS_ENABLED": "1"}, None, False, False, False),
        ({**GYM_ON, "NEMO_GYM_OTEL_TRACES_ENABLED": "false"}, None, False, False, False),
        ({"NEMO_GYM_OTEL_TRACES_ENABLED": "1"}, None, False, False, False),  # alone: Gym's telemetry is off
        ({"NEMO_GYM_OTEL_ENABLED": "0", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, None, True, True, False),
        ({**GYM_ON, "OTEL_SDK_DISABLED": "true"}, None, False, False, False),
        ({**GYM_ON, "OTEL_TRACES_EXPORTER": "none"}, None, False, False, False),
        ({}, {"enabled": True}, False, False, True),
        ({}, {"enabled": True, "traces_enabled": False}, True, True, False),
        ({}, {"enabled": False}, True, True, True),  # a block's false is never written out: the rest decides
        ({"NEMO_GYM_OTEL_ENABLED": "off"}, {"enabled": True}, False, False, False),  # the variable wins
        ({"NEMO_GYM_OTEL_TRACES_ENABLED": "0"}, {"enabled": True}, False, False, False),
        ({}, "not a mapping", True, True, True),
    ],
)
def test_nemo_gyms_telemetry_switches(
    environ: dict[str, str], block: Any, observability_enabled: bool, application_provider: bool, expected: bool
) -> None:
    assert decide_tracing(environ, observability_enabled, application_provider, block) is expected


def test_nemo_gyms_exporter_is_the_default_for_both_signals() -> None:
    environ = {**GYM_ON, "NEMO_GYM_OTEL_EXPORTER": "Console", "OTEL_METRICS_EXPORTER": "otlp"}
    effective = effective_environment(environ)
    assert (effective["OTEL_TRACES_EXPORTER"], effective["OTEL_METRICS_EXPORTER"]) == ("console", "otlp")
    assert effective_environment({}, {"enabled": True})["OTEL_TRACES_EXPORTER"] == "otlp"
    untouched = {"OTEL_SERVICE_NAME": "w"}
    assert effective_environment(untouched, {"enabled": False}) is untouched


def test_environment_without_a_say_leaves_it_to_the_config() -> None:
    assert environment_choice({"OTEL_SERVICE_NAME": "worker"}) is None


def peak_bytes_of_calls(function: Callable[[], object], calls: int = 200) -> int:
    """The most memory in use at once while `function` runs `calls` times, above what was in use before."""
    function()
    tracemalloc.start()
    try:
        loop = range(calls)
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        for _ in loop:
            function()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before


def test_trace_segment_is_empty_without_allocating() -> None:
    """The untraced path of apply_rollout_prefix: no span, so "" with no more memory than a function returning a
    constant (building the segment would take over 100 bytes)."""
    assert trace_context_path_segment() == ""
    assert peak_bytes_of_calls(trace_context_path_segment) <= peak_bytes_of_calls(lambda: "")


def test_the_allocation_probe_sees_an_allocation() -> None:
    assert peak_bytes_of_calls(lambda: "-".join(["/ng-trace", "00", "0" * 32])) > peak_bytes_of_calls(lambda: "")


# --- one trace, end to end ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced_by_config() -> dict[str, Any]:
    """The application's provider (in-memory exporter) and `observability_enabled: true`; no OTEL_* variable."""
    return run_scenario("app-provider", "--observability")


def test_control_plane_calls_are_children_of_the_worker_span(traced_by_config: dict[str, Any]) -> None:
    spans = traced_by_config["spans"]
    worker = only(spans, name="rollout-worker")
    assert worker["parent_id"] is None
    assert worker["span_id"] == traced_by_config["worker_span_id"]
    rpc_clients = [s for s in spans if s["kind"] == "CLIENT" and s["attributes"].get("rpc.system") == "grpc"]
    # GetGlobalConfig and GetServerStatus over the blocking channel, GetServerStatus over grpc.aio.
    assert sorted(s["attributes"]["rpc.method"] for s in rpc_clients) == [
        "GetGlobalConfig",
        "GetServerStatus",
        "GetServerStatus",
    ]
    for client in rpc_clients:
        assert client["trace_id"] == worker["trace_id"]
        assert client["parent_id"] == worker["span_id"]
        assert client["attributes"]["rpc.service"] == CONTROL_SERVICE
        (server,) = children(spans, client)
        assert server["kind"] == "SERVER"
        assert server["trace_id"] == worker["trace_id"]
        assert server["attributes"]["rpc.system"] == "grpc"
        assert server["attributes"]["rpc.service"] == CONTROL_SERVICE
        assert server["attributes"]["rpc.method"] == client["attributes"]["rpc.method"]
        assert server["attributes"]["rpc.grpc.status_code"] == 0


@pytest.mark.parametrize("server_name", ["policy", "judge"], ids=["aiohttp", "asgi"])
def test_header_propagation_continues_the_trace_on_the_receiving_server(
    traced_by_config: dict[str, Any], server_name: str
) -> None:
    spans = traced_by_config["spans"]
    worker = only(spans, name="rollout-worker")
    client = only(spans, kind="CLIENT", **{"gym.server.name": server_name, "http.response.status_code": 200})
    assert client["name"] == "POST"
    assert client["parent_id"] == worker["span_id"]
    assert client["trace_id"] == worker["trace_id"]
    attributes = client["attributes"]
    assert attributes["http.request.method"] == "POST"
    assert attributes["url.full"].endswith("/ng-rollout/rollout-7/v1/responses")
    assert attributes["server.address"] == LOOPBACK
    assert f":{attributes['server.port']}/" in attributes["url.full"]
    assert attributes["gym.rollout_id"] == ROLLOUT_ID
    assert client["status"] == "UNSET"

    (server,) = children(spans, client)
    assert server["kind"] == "SERVER"
    assert server["trace_id"] == worker["trace_id"]
    assert server["attributes"]["gym.rollout_id"] == ROLLOUT_ID
    assert server["attributes"]["http.response.status_code"] == 200
    assert server["attributes"]["url.path"] == "/ng-rollout/rollout-7/v1/responses"
    if server_name == "policy":  # aiohttp knows the route the stripped path resolved to
        assert server["name"] == "POST /v1/responses"
        assert server["attributes"]["http.route"] == "/v1/responses"
    else:
        assert server["name"] == "POST"
    seen = traced_by_config["header"][server_name]
    assert seen["traceparent"].split("-")[1:3] == [worker["trace_id"], client["span_id"]]
    assert seen["current_span_id"] == server["span_id"]  # the handler ran inside the server span
    assert seen["rollout_id"] == ROLLOUT_ID


@pytest.mark.parametrize("server_name", ["policy", "judge"], ids=["aiohttp", "asgi"])
def test_path_segment_propagation_from_an_uninstrumented_client(
    traced_by_config: dict[str, Any], server_name: str
) -> None:
    """A plain aiohttp session, outside any span, posting to the URL apply_rollout_prefix built inside the
    hand-off span: only the /ng-trace/ segment can carry the trace, and it does."""
    spans = traced_by_config["spans"]
    worker = only(spans, name="rollout-worker")
    hand_off = only(spans, name="hand-off")
    assert hand_off["parent_id"] == worker["span_id"]
    url = traced_by_config["handed_urls"][server_name]
    assert f"/ng-trace/00-{worker['trace_id']}-{hand_off['span_id']}-" in url
    seen = traced_by_config["path"][server_name]
    server = only(spans, span_id=seen["current_span_id"])
    assert server["kind"] == "SERVER"
    assert server["trace_id"] == worker["trace_id"]
    assert server["parent_id"] == hand_off["span_id"]
    assert server["attributes"]["gym.rollout_id"] == ROLLOUT_ID
    assert "/ng-trace/" in server["attributes"]["url.path"]
    assert seen["rollout_id"] == ROLLOUT_ID


def test_a_failed_answer_marks_both_spans(traced_by_config: dict[str, Any]) -> None:
    assert traced_by_config["fail_status"] == 500
    spans = traced_by_config["spans"]
    client = only(spans, kind="CLIENT", **{"http.response.status_code": 500})
    assert client["status"] == "ERROR"
    assert client["attributes"]["error.type"] == "500"
    (server,) = children(spans, client)
    assert server["status"] == "ERROR"
    assert server["attributes"]["http.response.status_code"] == 500


def test_every_gym_span_of_the_rollout_shares_one_trace(traced_by_config: dict[str, Any]) -> None:
    spans = traced_by_config["spans"]
    worker = only(spans, name="rollout-worker")
    in_trace = [s for s in spans if s["trace_id"] == worker["trace_id"]]
    # Worker, hand-off; 3 RPCs x (client, server); 3 data-plane calls x (client, server); 2 path-segment calls.
    assert len(in_trace) == 2 + 6 + 6 + 2
    others = [s for s in spans if s["trace_id"] != worker["trace_id"]]
    assert all(s["kind"] == "SERVER" and s["parent_id"] is None for s in others)  # the head's status probes


def test_environment_alone_turns_tracing_on() -> None:
    """OTEL_TRACES_EXPORTER set, the config silent: the first control call is already traced; without
    observability_enabled no rollout prefix goes out, yet the client span still names the rollout."""
    result = run_scenario("app-provider", OTEL_TRACES_EXPORTER="otlp")
    spans = result["spans"]
    worker = only(spans, name="rollout-worker")
    fetch = only(spans, kind="CLIENT", **{"rpc.method": "GetGlobalConfig"})
    assert fetch["parent_id"] == worker["span_id"]
    client = only(spans, kind="CLIENT", **{"gym.server.name": "policy", "http.response.status_code": 200})
    assert client["attributes"]["gym.rollout_id"] == ROLLOUT_ID
    assert client["attributes"]["url.full"].endswith(f":{client['attributes']['server.port']}/v1/responses")
    (server,) = children(spans, client)
    assert server["trace_id"] == worker["trace_id"]
    assert "gym.rollout_id" not in server["attributes"]


# --- off: nothing recorded, nothing installed --------------------------------------------------------------------


def test_off_records_nothing_and_installs_no_interceptor() -> None:
    """The application traces its own spans; gym_rpc, left off, adds none and sends no traceparent."""
    result = run_scenario("app-provider")
    assert result["tracing_enabled"] is False
    assert sorted(span["name"] for span in result["spans"]) == ["hand-off", "rollout-worker"]
    assert result["interceptors"] == {"aio_client": 0, "server": 0}
    assert result["modules"]["opentelemetry.instrumentation.grpc"] is False
    assert all(seen["traceparent"] is None for seen in result["header"].values())


def test_off_without_a_provider_imports_no_sdk() -> None:
    result = run_scenario("bare")
    assert result["tracing_enabled"] is False
    assert result["modules"] == {
        "opentelemetry.sdk.trace": False,
        "opentelemetry.instrumentation.grpc": False,
        "opentelemetry.propagate": False,
    }
    assert all("/ng-trace/" not in url for url in result["handed_urls"].values())
    assert all(seen["current_span_id"] is None for seen in [*result["header"].values(), *result["path"].values()])


def test_sdk_disabled_overrides_the_config() -> None:
    result = run_scenario("app-provider", "--observability", OTEL_SDK_DISABLED="true")
    assert result["tracing_enabled"] is False
    assert result["spans"] == []
    assert result["interceptors"] == {"aio_client": 0, "server": 0}
    assert result["modules"]["opentelemetry.instrumentation.grpc"] is False


DECISION_SCRIPT = """
import json, sys
from opentelemetry import trace
from gym_rpc import telemetry
app_provider = None
if sys.argv[1] == "app":
    from opentelemetry.sdk.trace import TracerProvider
    app_provider = TracerProvider()
    trace.set_tracer_provider(app_provider)
steps = [telemetry.tracing_enabled(), telemetry.setup_tracing(False), telemetry.setup_tracing(True),
         telemetry.setup_tracing(False), telemetry.tracing_enabled()]
provider = trace.get_tracer_provider()
print(json.dumps({"steps": steps, "kept_app_provider": provider is app_provider,
                  "provider": type(provider).__module__ + "." + type(provider).__name__,
                  "service": dict(getattr(provider, "resource", None).attributes).get("service.name")
                  if hasattr(provider, "resource") else None}))
"""


def run_decision(mode: str, **otel: str) -> dict[str, Any]:
    return run_json([sys.executable, "-c", DECISION_SCRIPT, mode], **otel)


def test_a_config_alone_does_not_trace_without_a_provider() -> None:
    result = run_decision("none")
    assert result["steps"] == [False, False, False, False, False]
    assert result["provider"] == "opentelemetry.trace.ProxyTracerProvider"  # nothing installed


def test_an_exporter_in_the_environment_installs_the_sdk_provider() -> None:
    result = run_decision("none", OTEL_TRACES_EXPORTER="console")
    assert result["steps"] == [True, True, True, True, True]
    assert result["provider"] == "opentelemetry.sdk.trace.TracerProvider"
    assert result["service"] == "gym-rpc"


def test_the_applications_provider_is_kept() -> None:
    result = run_decision("app", OTEL_SERVICE_NAME="my-worker")
    assert result["steps"] == [False, False, True, True, True]
    assert result["kept_app_provider"] is True


def test_nemo_gyms_variables_install_the_sdk_provider_with_its_exporter() -> None:
    result = run_decision("none", NEMO_GYM_OTEL_ENABLED="true", NEMO_GYM_OTEL_EXPORTER="console")
    assert result["steps"] == [True, True, True, True, True]
    assert result["provider"] == "opentelemetry.sdk.trace.TracerProvider"


def test_forced_off_stays_off_whatever_the_config() -> None:
    result = run_decision("none", OTEL_TRACES_EXPORTER="none")
    assert result["steps"] == [False, False, False, False, False]
    assert result["provider"] == "opentelemetry.trace.ProxyTracerProvider"  # nothing installed


# --- OTLP: spans reach a collector -------------------------------------------------------------------------------


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on loopback that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    await server.start()
    yield servicer, port
    await server.stop(None)


# The [otlp] extra's floor (1.43) pins the SDK to its own release: the lowest-versions venv (SDK 1.28) has none.
needs_the_otlp_exporter = pytest.mark.skipif(
    importlib.util.find_spec("opentelemetry.exporter.otlp") is None, reason="the [otlp] extra is not installed"
)


@needs_the_otlp_exporter
async def test_otlp_endpoint_exports_the_trace(collector: tuple[Collector, int]) -> None:
    """No provider of the application's: gym_rpc installs the SDK's with an OTLP exporter, because
    OTEL_EXPORTER_OTLP_ENDPOINT is set, and the spans reach the collector at exit."""
    servicer, port = collector
    env = scenario_environment(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{LOOPBACK}:{port}")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCENARIO),
        "otlp",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), SCENARIO_TIMEOUT_SECONDS)
    assert process.returncode == 0, stderr.decode()
    result = json.loads(stdout)
    assert result["tracing_enabled"] is True
    assert result["modules"]["opentelemetry.sdk.trace"] is True
    exported = [
        (resource_spans.resource, span)
        for request in servicer.requests
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    worker = [span for _, span in exported if span.name == "rollout-worker"]
    assert len(worker) == 1
    in_trace = [span for _, span in exported if span.trace_id == worker[0].trace_id]
    names = {span.name for span in in_trace}
    assert f"/{CONTROL_SERVICE}/GetGlobalConfig" in names
    assert {"POST", "POST /v1/responses"} <= names
    services = {
        attribute.value.string_value
        for resource, _ in exported
        for attribute in resource.attributes
        if attribute.key == "service.name"
    }
    assert services == {"gym-rpc-head"}  # the head decided first, in this one-process rollout


# --- the rules README states for watches, health checks, server_span() and the environment -----------------------


@pytest.fixture(scope="module")
def traced_with_rules() -> dict[str, Any]:
    """As `traced_by_config`, plus a watch and a health check in the worker's span, a bare health check outside
    any span, and a server that uses server_span() instead of the middleware."""
    return run_scenario("app-provider", "--observability", "--rules")


def test_status_watches_are_not_traced(traced_with_rules: dict[str, Any]) -> None:
    """README: "Status watches are long-lived streams and are not traced"."""
    assert traced_with_rules["watch_kind"] == "snapshot"  # the watch ran, inside the worker's span
    methods = [span["attributes"].get("rpc.method") for span in traced_with_rules["spans"]]
    assert "WatchServerStatuses" not in methods


def test_health_checks_are_traced_only_when_they_continue_a_trace(traced_with_rules: dict[str, Any]) -> None:
    """README: "health checks are traced on the head only when they continue a caller's trace (Kubernetes probes
    would flood it)": the check made in the worker's span has a server span, the bare probe none."""
    assert (traced_with_rules["traced_health"], traced_with_rules["probe_health"]) == (1, 1)  # both SERVING
    spans = traced_with_rules["spans"]
    worker = only(spans, name="rollout-worker")
    checks = [span for span in spans if span["name"] == "/grpc.health.v1.Health/Check"]
    assert sorted(span["kind"] for span in checks) == ["CLIENT", "SERVER"]
    client = only(checks, kind="CLIENT")
    assert client["parent_id"] == worker["span_id"]
    assert only(checks, kind="SERVER")["parent_id"] == client["span_id"]


def test_server_span_continues_the_callers_trace_without_the_middleware(traced_with_rules: dict[str, Any]) -> None:
    """README: "A server without the middleware can do the same with gym_rpc.telemetry.server_span(...)"."""
    spans = traced_with_rules["spans"]
    worker = only(spans, name="rollout-worker")
    client = only(spans, kind="CLIENT", **{"gym.server.name": "plain"})
    (server,) = children(spans, client)
    assert (server["kind"], server["name"], server["trace_id"]) == ("SERVER", "POST", worker["trace_id"])
    assert server["attributes"]["http.response.status_code"] == 200
    assert traced_with_rules["header"]["plain"]["current_span_id"] == server["span_id"]  # the handler ran in it


def test_otel_propagators_chooses_what_carries_the_context() -> None:
    """README: the context goes out in `traceparent` "(the global propagator: W3C trace context unless
    OTEL_PROPAGATORS says otherwise)": with only `baggage` propagated, no traceparent header is sent and the
    receiving server starts a trace of its own."""
    result = run_scenario("app-provider", "--observability", OTEL_PROPAGATORS="baggage")
    assert result["header"]["policy"]["traceparent"] is None
    spans = result["spans"]
    worker = only(spans, name="rollout-worker")
    server = only(spans, name="POST /v1/responses", **{"url.path": "/ng-rollout/rollout-7/v1/responses"})
    assert server["trace_id"] != worker["trace_id"] and server["parent_id"] is None


async def test_otel_traces_sampler_is_followed(collector: tuple[Collector, int]) -> None:
    """README: "Sampling follows the SDK's OTEL_TRACES_SAMPLER": with `always_off`, tracing is on and nothing is
    exported (test_otlp_endpoint_exports_the_trace is the same run with the default sampler)."""
    servicer, port = collector
    env = scenario_environment(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{LOOPBACK}:{port}", OTEL_TRACES_SAMPLER="always_off"
    )
    pipe = asyncio.subprocess.PIPE
    command = [sys.executable, str(SCENARIO), "otlp"]
    process = await asyncio.create_subprocess_exec(*command, env=env, stdout=pipe, stderr=pipe)
    stdout, stderr = await asyncio.wait_for(process.communicate(), SCENARIO_TIMEOUT_SECONDS)
    assert process.returncode == 0, stderr.decode()
    assert json.loads(stdout)["tracing_enabled"] is True
    assert servicer.requests == []


@needs_the_otlp_exporter
async def test_otlp_over_http_protobuf_exports_the_trace() -> None:
    """README: "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf for HTTP": the spans reach an OTLP/HTTP collector
    (POST /v1/traces, protobuf body)."""
    from aiohttp import web

    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    async def export(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        received.append(trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read()))
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", export)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    port = int(runner.addresses[0][1])
    try:
        env = scenario_environment(
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{LOOPBACK}:{port}", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf"
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SCENARIO),
            "otlp",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(process.communicate(), SCENARIO_TIMEOUT_SECONDS)
    finally:
        await runner.cleanup()
    assert process.returncode == 0, stderr.decode()
    names = {
        span.name
        for request in received
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    }
    assert {"rollout-worker", f"/{CONTROL_SERVICE}/GetGlobalConfig", "POST", "POST /v1/responses"} <= names
