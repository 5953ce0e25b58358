"""One OpenTelemetry trace across the control plane, the data plane and the receiving server; off (and free) by
default.

When is tracing on? Decided once per process, by `setup_tracing()` or the first `tracing_enabled()`:

0. NeMo Gym's own switches (`NEMO_GYM_OTEL_*` variables, its config's `telemetry:` block) are first read as the
   OTEL_* variables they mean (`gym_rpc._telemetry_switches`): Gym's telemetry on sets the traces exporter, off
   sets it to `none`.
1. `OTEL_SDK_DISABLED=true`, or `OTEL_TRACES_EXPORTER=none`: off, whatever the config says.
2. `OTEL_TRACES_EXPORTER` naming an exporter, or `OTEL_EXPORTER_OTLP_ENDPOINT` /
   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set: on.
3. Otherwise `observability_enabled: true` in the global config turns it on when the application has installed
   its own TracerProvider (spans have somewhere to go); a process that has already decided "off" turns on when
   such a config arrives, e.g. a worker once it fetched the config; never the other way round.
4. Otherwise off: `observability_enabled` alone (the rollout prefixes) costs no tracing, since spans that no
   exporter takes would only slow every call.

On means: the control channels carry OpenTelemetry's gRPC client interceptors and the head its server interceptor
(rpc.* semantic conventions), every `ServerClient` call is a CLIENT span (http.* conventions, `gym.rollout_id`)
whose context travels in the `traceparent` header, and `TraceContextPathMiddleware` continues the caller's trace
in a SERVER span. Off means none of that exists: no interceptor, no SDK import, one boolean check per call.
OpenTelemetry's API itself loads with the first call that needs it, not with this module.

Spans go to the TracerProvider the application installed, if any (never replaced). Otherwise `setup_tracing`
installs the SDK's, with an OTLP exporter when `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` is set (the `gym-rpc[otlp]`
extra; `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf` picks HTTP over the default gRPC) or `OTEL_TRACES_EXPORTER`
asks for it, and a console exporter for `OTEL_TRACES_EXPORTER=console`.

This module holds the decision and what both sides share (the tracer, attribute names, SERVER spans); each side
keeps its own instrumentation: `gym_rpc.client.tracing._grpc_interceptors` (control channels),
`gym_rpc.client.data._call_spans` (data-plane calls), `gym_rpc.server.observability._grpc_tracing` (the head's
interceptor), `gym_rpc.integrations._middleware` (receiving servers).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gym_rpc._environment import (
    OTLP_TRACES_ENDPOINT_ENV_VARS,
    OTLP_TRACES_PROTOCOL_ENV_VARS,
    SDK_DISABLED_ENV_VAR,
    TRACES_EXPORTER_ENV_VAR,
    environment,
)
from gym_rpc._logging import RateLimitedLog
from gym_rpc._telemetry_switches import effective_environment
from gym_rpc._version import __version__

if TYPE_CHECKING:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import SpanProcessor

logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "gym-rpc"
TRACER_NAME = "gym_rpc"

# Attribute names: OpenTelemetry's http semantic conventions, and Gym's own under `gym.`.
HTTP_REQUEST_METHOD = "http.request.method"
HTTP_REQUEST_METHOD_ORIGINAL = "http.request.method_original"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
HTTP_ROUTE = "http.route"
URL_FULL = "url.full"
URL_PATH = "url.path"
URL_SCHEME = "url.scheme"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
ROLLOUT_ID_ATTRIBUTE = "gym.rollout_id"
SERVER_NAME_ATTRIBUTE = "gym.server.name"

_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


class TracingState:
    """The process's decision; `enabled` is what hot paths read (one attribute, no call)."""

    __slots__ = ("decided", "enabled", "environment_says")

    def __init__(self) -> None:
        self.decided = False
        self.enabled = False
        self.environment_says: bool | None = None


TRACING = TracingState()
_lock = threading.Lock()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def exporter_names(environ: Mapping[str, str], variable: str = TRACES_EXPORTER_ENV_VAR) -> list[str]:
    """The exporters an OTEL_*_EXPORTER variable names, lower case (metrics reads its own the same way)."""
    raw = environ.get(variable) or ""
    return [name.strip().lower() for name in raw.split(",") if name.strip()]


def otlp_endpoint_set(
    environ: Mapping[str, str], variables: tuple[str, ...] = OTLP_TRACES_ENDPOINT_ENV_VARS
) -> bool:
    return any((environ.get(name) or "").strip() for name in variables)


def otlp_protocol(environ: Mapping[str, str], variables: tuple[str, ...] = OTLP_TRACES_PROTOCOL_ENV_VARS) -> str:
    """The OTLP protocol the first set variable names, else gRPC (OpenTelemetry's default)."""
    return next((environ[name].strip() for name in variables if environ.get(name)), "grpc")


def environment_choice(environ: Mapping[str, str]) -> bool | None:
    """What the OTEL_* variables say: False (forced off), True (on), None (nothing: the config decides)."""
    if _truthy(environ.get(SDK_DISABLED_ENV_VAR)):
        return False
    exporters = exporter_names(environ)
    if "none" in exporters:
        return False
    if exporters or otlp_endpoint_set(environ):
        return True
    return None


def decide_tracing(
    environ: Mapping[str, str],
    observability_enabled: bool,
    application_provider: bool,
    telemetry_block: Any = None,
) -> bool:
    """The rule of this module's docstring, as a pure function (`telemetry_block`: the config's `telemetry:`)."""
    choice = environment_choice(effective_environment(environ, telemetry_block))
    return _decision(choice, observability_enabled, application_provider)


def _decision(environment_says: bool | None, observability_enabled: bool, application_provider: bool) -> bool:
    if environment_says is not None:
        return environment_says
    return observability_enabled and application_provider


def _application_provider_installed() -> bool:
    """Whether the application (or OTEL_PYTHON_TRACER_PROVIDER) installed a TracerProvider of its own."""
    from opentelemetry import trace

    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def tracing_enabled() -> bool:
    """Whether this process traces; the first call decides from the environment alone."""
    if not TRACING.decided:
        setup_tracing()
    return TRACING.enabled


def setup_tracing(
    observability_enabled: bool = False, *, service_name: str | None = None, telemetry_block: Any = None
) -> bool:
    """Decide whether to trace (until it is on) and, when on, make sure a TracerProvider records the spans.

    Called by the head and by ServerClient with their config's observability_enabled and `telemetry:` block;
    applications may call it first to set `service_name`. Returns the decision.
    """
    if TRACING.enabled or (TRACING.decided and not observability_enabled and telemetry_block is None):
        return TRACING.enabled
    environ = effective_environment(environment().by_name(), telemetry_block)
    with _lock:
        TRACING.environment_says = environment_choice(environ)
        TRACING.decided = True
        turn_on = _decision(TRACING.environment_says, observability_enabled, _application_provider_installed())
        if turn_on and not TRACING.enabled:
            _ensure_tracer_provider(service_name, environ)
            TRACING.enabled = True
        return TRACING.enabled


# --- the TracerProvider ------------------------------------------------------------------------------------------


def _ensure_tracer_provider(service_name: str | None, environ: Mapping[str, str]) -> None:
    """Install the SDK's provider with the configured exporters, unless the application installed one."""
    if _application_provider_installed():
        return  # never replaced
    try:  # the SDK is imported only once tracing is on: off costs no SDK import
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:
        logger.warning(
            "tracing is on but opentelemetry-sdk is not installed: spans are not recorded "
            "(pip install 'gym-rpc[otlp]')"
        )
        return
    from opentelemetry import trace

    provider = TracerProvider(resource=Resource.create(_resource_attributes(service_name)))
    for processor in _span_processors(environ):
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)


def _resource_attributes(service_name: str | None) -> dict[str, str]:
    """service.name: OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES win (the SDK reads them), else ours."""
    env = environment()
    named_by_environment = env.otel_service_name or "service.name=" in (env.otel_resource_attributes or "")
    return {} if named_by_environment else {"service.name": service_name or DEFAULT_SERVICE_NAME}


def _span_processors(environ: Mapping[str, str]) -> list[SpanProcessor]:
    names = exporter_names(environ) or (["otlp"] if otlp_endpoint_set(environ) else [])
    processors: list[SpanProcessor] = []
    for name in dict.fromkeys(names):
        if name == "otlp":
            processor = _otlp_processor(environ)
            if processor is not None:
                processors.append(processor)
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

            processors.append(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            logger.warning(
                "%s=%s: exporter %r is not supported (otlp, console)", TRACES_EXPORTER_ENV_VAR, name, name
            )
    return processors


def _otlp_processor(environ: Mapping[str, str]) -> SpanProcessor | None:
    """A batching processor with the OTLP exporter the protocol variable asks for (gRPC by default)."""
    protocol = otlp_protocol(environ)
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    try:
        exporter: SpanExporter
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            exporter = HttpExporter()
        else:
            logger.warning(
                "OTLP protocol %r is not supported (grpc, http/protobuf): spans are not exported", protocol
            )
            return None
    except ImportError:
        logger.warning("an OTLP endpoint is set but the exporter is not installed: pip install 'gym-rpc[otlp]'")
        return None
    return BatchSpanProcessor(exporter)


@functools.cache
def tracer() -> trace.Tracer:
    """gym_rpc's tracer (a proxy until a provider is installed, then the provider's)."""
    from opentelemetry import trace

    return trace.get_tracer(TRACER_NAME, __version__)


# --- instrumentation that fails --------------------------------------------------------------------------------

# Seconds between two log lines about the same kind of failure (the lines in between are counted, not logged).
FAILURE_LOG_INTERVAL_SECONDS = 10.0
_failure_logs: dict[str, RateLimitedLog] = {}


def instrumentation_failed(kind: str, error: BaseException) -> None:
    """What gym_rpc does with an exception from OpenTelemetry's side of a call (a span processor, an exporter, a
    sampler, an instrument): log it, at most once per FAILURE_LOG_INTERVAL_SECONDS for each `kind` ("tracing",
    "metrics"), and go on: instrumentation may fail, a call may not."""
    log = _failure_logs.get(kind)
    if log is None:
        log = _failure_logs[kind] = RateLimitedLog(logger, FAILURE_LOG_INTERVAL_SECONDS)
    message = f"{kind} failed and was skipped ({type(error).__name__}: {error}); the call goes on"
    log.warning(message, exc_info=error)


# --- data plane: CLIENT spans and propagation --------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def method_attributes(method: str) -> Mapping[str, str]:
    """http.request.method as the conventions spell it: a known method in upper case, else _OTHER + the original.
    Shared and cached: callers copy it."""
    upper = method.upper()
    if upper in _KNOWN_METHODS:
        return {HTTP_REQUEST_METHOD: upper}
    return {HTTP_REQUEST_METHOD: "_OTHER", HTTP_REQUEST_METHOD_ORIGINAL: method}


def span_name(method: str) -> str:
    """The conventions' span name: the method, or HTTP for one they do not know."""
    upper = method.upper()
    return upper if upper in _KNOWN_METHODS else "HTTP"


@functools.cache
def propagation() -> Any:
    """opentelemetry.propagate, imported on first traced call (its import loads the configured propagators)."""
    from opentelemetry import propagate

    return propagate


def record_failure(span: trace.Span, error: BaseException) -> None:
    """An exception instead of an answer: error.type, the exception event and the span's error status."""
    from opentelemetry import trace

    span.set_attribute(ERROR_TYPE, type(error).__qualname__)
    span.record_exception(error)
    span.set_status(trace.Status(trace.StatusCode.ERROR, str(error) or type(error).__name__))


def is_error_status(status: int, *, server: bool) -> bool:
    """Whether an HTTP answer makes the span an error, as the http conventions say (server: 5xx; client: 4xx)."""
    return status >= 500 or (status >= 400 and not server)


def set_response_status(span: trace.Span, status: int, *, server: bool) -> None:
    """The status code, and the span's error status (`is_error_status`) with the code as its error.type."""
    span.set_attribute(HTTP_RESPONSE_STATUS_CODE, status)
    if is_error_status(status, server=server):
        span.set_attribute(ERROR_TYPE, str(status))
        from opentelemetry import trace

        span.set_status(trace.Status(trace.StatusCode.ERROR))


# --- receiving servers: SERVER spans continuing the caller's trace -----------------------------------------------


@contextlib.contextmanager
def server_span(
    method: str,
    headers: Mapping[str, str],
    *,
    path: str,
    scheme: str,
    rollout_id: str | None,
    route: str | None = None,
    server_address: tuple[str, int] | None = None,
) -> Iterator[trace.Span]:
    """A SERVER span continuing the trace of `headers` (`traceparent`, read with the global propagator); the
    handler runs inside it, so its own spans and calls are children of the caller's span. What the tracer raises
    (a sampler, a span processor) is logged, never the handler's: tracing may fail, a request may not.

    For servers that do not use `TraceContextPathMiddleware` but want the same: `with server_span(...) as span:`
    around the handler, then `set_response_status(span, status, server=True)` (or `record_failure(span, error)`
    for an exception that is no HTTP answer).
    """
    from opentelemetry import trace

    context = propagation().extract(headers)
    attributes: dict[str, Any] = {**method_attributes(method), URL_PATH: path, URL_SCHEME: scheme}
    if route:
        attributes[HTTP_ROUTE] = route
    if server_address is not None:
        attributes[SERVER_ADDRESS], attributes[SERVER_PORT] = server_address
    if rollout_id is not None:
        attributes[ROLLOUT_ID_ATTRIBUTE] = rollout_id
    name = f"{span_name(method)} {route}" if route else span_name(method)
    try:
        span = tracer().start_span(name, context=context, kind=trace.SpanKind.SERVER, attributes=attributes)
    except (
        Exception
    ) as error:  # a sampler or processor that raises: the handler runs in the caller's trace, unrecorded
        instrumentation_failed("tracing", error)
        span = trace.NonRecordingSpan(trace.get_current_span(context).get_span_context())
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield span
    finally:
        try:
            span.end()
        except Exception as error:
            instrumentation_failed("tracing", error)
