"""OpenTelemetry metrics for gym_rpc processes: when they are on, where they go.

The head always measures (it is off the hot path): its instruments go to the process's MeterProvider, which the
head installs when the application has none, with a Prometheus reader behind `GET /metrics` and an OTLP reader
when the environment asks for one. Rollout workers (ServerClient) measure only when metrics are on for them, and
otherwise pay one boolean check per call:

0. NeMo Gym's own switches (`NEMO_GYM_OTEL_*` variables, the config's `telemetry:` block) are first read as the
   OTEL_* variables they mean (`gym_rpc._telemetry_switches`): Gym's telemetry on sets the metrics exporter, off
   (or its metrics off) sets it to `none`.
1. `OTEL_SDK_DISABLED=true` or `OTEL_METRICS_EXPORTER=none`: off everywhere (the head's /metrics answers 404).
2. `OTEL_METRICS_EXPORTER` naming an exporter (`otlp`, `console`), or `OTEL_EXPORTER_OTLP_ENDPOINT` /
   `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` set: on, exported there.
3. `enable_client_metrics()` called by the application (which installed its own MeterProvider): on.
4. Otherwise off for workers, on for the head (Prometheus only).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from gym_rpc._environment import (
    EXEMPLAR_FILTER_ENV_VAR,
    METRICS_EXPORTER_ENV_VAR,
    OTLP_METRICS_ENDPOINT_ENV_VARS,
    OTLP_METRICS_PROTOCOL_ENV_VARS,
    SDK_DISABLED_ENV_VAR,
    environment,
)
from gym_rpc._telemetry_switches import effective_environment
from gym_rpc._version import __version__
from gym_rpc.telemetry import exporter_names, otlp_endpoint_set, otlp_protocol

if TYPE_CHECKING:
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METER_NAME = "gym_rpc"


class MetricsState:
    """`enabled`: whether ServerClient records its metrics (read on every call: a plain attribute)."""

    __slots__ = ("enabled", "prometheus", "telemetry_block")

    def __init__(self) -> None:
        self.enabled = False
        self.prometheus = False  # a Prometheus reader feeds prometheus_client's registry (the head's /metrics)
        self.telemetry_block: Any = None  # the config's `telemetry:` (NeMo Gym's switches), once one was given


METRICS = MetricsState()
_lock = threading.Lock()
_provider_installed = False


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    return exporter_names(environ, METRICS_EXPORTER_ENV_VAR)


def _environment(telemetry_block: Any = None) -> Mapping[str, str]:
    """The process's environment with NeMo Gym's switches applied (this block, else the last one given)."""
    if telemetry_block is not None:
        METRICS.telemetry_block = telemetry_block
    return effective_environment(environment().by_name(), METRICS.telemetry_block)


def metrics_disabled(environ: Mapping[str, str] | None = None) -> bool:
    """OTEL_SDK_DISABLED=true or OTEL_METRICS_EXPORTER=none: no metrics at all."""
    env = _environment() if environ is None else environ
    if (env.get(SDK_DISABLED_ENV_VAR) or "").strip().lower() == "true":
        return True
    return _exporter_names(env) == ["none"]


def metrics_exported(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment names a metrics exporter or an OTLP endpoint (rule 2 above)."""
    env = _environment() if environ is None else environ
    if metrics_disabled(env):
        return False
    names = [n for n in _exporter_names(env) if n != "none"]
    return bool(names) or otlp_endpoint_set(env, OTLP_METRICS_ENDPOINT_ENV_VARS)


# The global MeterProvider at gym_rpc's first look (OpenTelemetry is not imported with this module): the API's
# stand-in unless one was set before.
_provider_at_first_look: object | None = None


def _application_provider_installed() -> bool:
    """Whether a MeterProvider is installed, on public facts: the SDK's (whoever set it), or any other set since
    gym_rpc first looked (one set earlier and not the SDK's goes unseen: `setup_metrics` then finds its own
    refused by `set_meter_provider`, and shuts it down)."""
    global _provider_at_first_look
    from opentelemetry import metrics

    provider = metrics.get_meter_provider()
    if _provider_at_first_look is None:
        _provider_at_first_look = provider
    try:
        from opentelemetry.sdk.metrics import MeterProvider
    except ImportError:  # a base install: no SDK, so any provider installed is another one
        return provider is not _provider_at_first_look
    return isinstance(provider, MeterProvider) or provider is not _provider_at_first_look


def _readers(environ: Mapping[str, str], prometheus: bool) -> list[MetricReader]:
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers: list[MetricReader] = []
    if prometheus:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        readers.append(PrometheusMetricReader())
    names = _exporter_names(environ) or (
        ["otlp"] if otlp_endpoint_set(environ, OTLP_METRICS_ENDPOINT_ENV_VARS) else []
    )
    for name in dict.fromkeys(names):
        if name == "otlp":
            exporter = _otlp_exporter(environ)
            if exporter is not None:
                readers.append(PeriodicExportingMetricReader(exporter))
        elif name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name not in ("prometheus", "none"):
            logger.warning(
                "%s=%s: exporter %r is not supported (otlp, console)", METRICS_EXPORTER_ENV_VAR, name, name
            )
    return readers


def _otlp_exporter(environ: Mapping[str, str]) -> MetricExporter | None:
    protocol = otlp_protocol(environ, OTLP_METRICS_PROTOCOL_ENV_VARS)
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            return OTLPMetricExporter()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

            return HttpExporter()
    except ImportError:
        logger.warning("an OTLP endpoint is set but the exporter is not installed: pip install 'gym-rpc[otlp]'")
        return None
    logger.warning("OTLP protocol %r is not supported (grpc, http/protobuf): metrics are not exported", protocol)
    return None


def setup_metrics(*, service_name: str, prometheus: bool, telemetry_block: Any = None) -> bool:
    """Install the SDK's MeterProvider (once per process, never replacing the application's) with the readers the
    environment asks for, plus a Prometheus reader when `prometheus`. False when metrics are disabled."""
    global _provider_installed
    environ = _environment(telemetry_block)
    if metrics_disabled(environ):
        return False
    with _lock:
        if _provider_installed or _application_provider_installed():
            return True
        try:  # the SDK is the `tracing` extra's (and the head's): a base install records no metrics
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.resources import Resource
        except ImportError:
            logger.warning(
                "metrics are switched on but opentelemetry-sdk is not installed: they are not recorded "
                "(pip install 'gym-rpc[otlp]')"
            )
            return False

        attributes = {} if environment().otel_service_name else {"service.name": service_name}
        readers = _readers(environ, prometheus)
        provider = MeterProvider(
            metric_readers=readers, resource=Resource.create(attributes), **_exemplar_filter(environ)
        )
        from opentelemetry import metrics

        metrics.set_meter_provider(provider)
        if metrics.get_meter_provider() is not provider:  # one was there already: the application's stays
            provider.shutdown()
            return True
        _provider_installed = True
        METRICS.prometheus = prometheus
        return True


def _exemplar_filter(environ: Mapping[str, str]) -> dict[str, Any]:
    """No exemplars unless OTEL_METRICS_EXEMPLAR_FILTER asks for them: the SDK's default (trace-based) reads the
    current span on every measurement, a cost on each ServerClient call."""
    if environ.get(EXEMPLAR_FILTER_ENV_VAR):
        return {}  # the SDK reads the variable itself
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter

    return {"exemplar_filter": AlwaysOffExemplarFilter()}


def setup_client_metrics(service_name: str = "gym-rpc", telemetry_block: Any = None) -> bool:
    """Turn worker metrics on when the environment exports them (rule 2); called by every ServerClient with its
    config's `telemetry:` block."""
    if METRICS.enabled or not metrics_exported(_environment(telemetry_block)):
        return METRICS.enabled
    if setup_metrics(service_name=service_name, prometheus=False):
        METRICS.enabled = True
    return METRICS.enabled


def enable_client_metrics() -> None:
    """Record ServerClient metrics into the process's MeterProvider (install yours first, or the environment's
    exporters are used): `http.client.request.duration`, resends, unreachable servers, requests in flight."""
    if metrics_disabled():
        return
    if not _application_provider_installed():
        setup_metrics(service_name="gym-rpc", prometheus=False)
    METRICS.enabled = True


def disable_client_metrics() -> None:
    """Stop recording ServerClient metrics (one boolean check per call again)."""
    METRICS.enabled = False


def prometheus_text() -> bytes:
    """Everything prometheus_client's default registry holds, in the Prometheus text format (the head's
    /metrics)."""
    import prometheus_client

    return prometheus_client.generate_latest()


def meter() -> metrics.Meter:
    from opentelemetry import metrics

    return metrics.get_meter(METER_NAME, __version__)


def seconds_histogram(name: str, description: str, buckets: Iterable[float]) -> metrics.Histogram:
    """A duration histogram in seconds with its bucket boundaries (the advice exporters honour)."""
    return meter().create_histogram(
        name, unit="s", description=description, explicit_bucket_boundaries_advisory=list(buckets)
    )
