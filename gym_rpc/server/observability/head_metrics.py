"""The head's metrics (OpenTelemetry instruments; Prometheus names in README "Metrics").

Gauges are observed when a reader collects (a scrape of /metrics, an OTLP export), from the live heads of the
process, so they cost nothing between scrapes; the probe histogram and the status-change counter are recorded as
probes are stored; the RPC histogram by a server interceptor.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from opentelemetry.metrics import CallbackOptions, Histogram, Observation

from gym_rpc.config import ServerEntry
from gym_rpc.metrics import meter, seconds_histogram
from gym_rpc.wire import InstanceReport, StatusReport

SERVER_NAME = "gym.server.name"
SERVER_TYPE = "gym.server.type"
SERVER_STATUS = "gym.server.status"
INSTANCE_STATE = "gym.instance.state"
# What `gym.server.instances` counts: answering and not draining, draining (whatever it answers), not answering,
# not probed yet.
INSTANCE_STATES = ("up", "draining", "down", "pending")
# Seconds: probes on loopback take a millisecond, a silent server the whole probe timeout.
PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Per-instance series (gym.instance.*): off by default, since instance ids are addresses and the head's metrics
# carry none unless asked (SECURITY.md); with `--instance-series N`, at most N instances per head (N <=
# MAX_INSTANCE_SERIES) are exported one by one, in the prober's order (config instances and replicas first, then
# registered ones), the rest counted in gym.head.instance_series_dropped. gym.server.instances counts them all.
DEFAULT_INSTANCE_SERIES = 0
MAX_INSTANCE_SERIES = 10_000
INSTANCE_ID = "gym.server.instance.id"  # an instance's host:port, as the workers' gym.client.instance.* carry it
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _Reports(Protocol):
    revision: int

    def reports(self) -> list[StatusReport]: ...


class ObservedHead(Protocol):
    """What the gauges read from a head (the head server and the bridge)."""

    @property
    def observed_servers(self) -> Mapping[str, ServerEntry]: ...

    @property
    def observed_prober(self) -> _Reports: ...

    @property
    def observed_watchers(self) -> int: ...

    @property
    def observed_registrations(self) -> int: ...

    @property
    def observed_instance_series(self) -> int: ...

    def observed_in_flight(self, server_name: str) -> Mapping[str, int]: ...


_heads: weakref.WeakSet[Any] = weakref.WeakSet()


def observe(head: ObservedHead) -> None:
    """Report `head`'s gauges from now on (until it is garbage; `forget` when it stops)."""
    _instruments()
    _heads.add(head)


def forget(head: ObservedHead) -> None:
    _heads.discard(head)


def _up(options: CallbackOptions) -> Iterable[Observation]:
    for head in list(_heads):
        servers = head.observed_servers
        for report in head.observed_prober.reports():
            entry = servers.get(report.server_name)
            attributes = {SERVER_NAME: report.server_name, SERVER_TYPE: entry.server_type if entry else ""}
            yield Observation(1 if report.status == "success" else 0, attributes)


def instance_state(instance: InstanceReport) -> str:
    if instance.draining:
        return "draining"
    if instance.status is None:
        return "pending"
    return "up" if instance.status == "success" else "down"


def _instances(options: CallbackOptions) -> Iterable[Observation]:
    """Every server's instances, counted by state (every state, 0s too, so a series never just vanishes). Not one
    series per instance: metrics carry no addresses (SECURITY.md), and instance ids are addresses."""
    for head in list(_heads):
        for report in head.observed_prober.reports():
            states = [instance_state(instance) for instance in report.instances]
            for state in INSTANCE_STATES:
                yield Observation(states.count(state), {SERVER_NAME: report.server_name, INSTANCE_STATE: state})


def _exported_instances(head: Any) -> Iterator[tuple[str, InstanceReport]]:
    """The head's instances exported one by one: the first `observed_instance_series` of them."""
    left = head.observed_instance_series
    for report in head.observed_prober.reports():
        for instance in report.instances[:left]:
            yield report.server_name, instance
        left -= min(left, len(report.instances))
        if not left:
            return


def _instance_up(options: CallbackOptions) -> Iterable[Observation]:
    for head in list(_heads):
        for name, instance in _exported_instances(head):
            up = instance.status == "success" and not instance.draining
            yield Observation(1 if up else 0, {SERVER_NAME: name, INSTANCE_ID: instance.instance_id})


def _instance_in_flight(options: CallbackOptions) -> Iterable[Observation]:
    for head in list(_heads):
        reported: dict[str, Mapping[str, int]] = {}
        for name, instance in _exported_instances(head):
            if name not in reported:
                reported[name] = head.observed_in_flight(name)
            count = reported[name].get(instance.instance_id)
            if count is not None:
                yield Observation(count, {SERVER_NAME: name, INSTANCE_ID: instance.instance_id})


def _instance_downs(options: CallbackOptions) -> Iterable[Observation]:
    for head in list(_heads):
        for name, instance in _exported_instances(head):
            yield Observation(
                _downs.get((name, instance.instance_id), 0), {SERVER_NAME: name, INSTANCE_ID: instance.instance_id}
            )


def _series_dropped(options: CallbackOptions) -> Iterable[Observation]:
    for head in list(_heads):
        if not head.observed_instance_series:
            continue  # off: nothing is dropped, nothing was asked for
        total = sum(len(report.instances) for report in head.observed_prober.reports())
        yield Observation(max(0, total - head.observed_instance_series))


# Times each instance stopped answering (success -> a failure): the head's ejections, which take it out of the
# healthy set it sends workers. Bounded: the oldest entries go first past twice the default cap.
_downs: dict[tuple[str, str], int] = {}


def instance_went_down(name: str, instance_id: str) -> None:
    key = (name, instance_id)
    _downs[key] = _downs.pop(key, 0) + 1
    while len(_downs) > MAX_INSTANCE_SERIES:
        del _downs[next(iter(_downs))]


def _revision(options: CallbackOptions) -> Iterable[Observation]:
    for head in list(_heads):
        yield Observation(head.observed_prober.revision)


def _watchers(options: CallbackOptions) -> Iterable[Observation]:
    for head in list(_heads):
        yield Observation(head.observed_watchers)


def _registrations(options: CallbackOptions) -> Iterable[Observation]:
    for head in list(_heads):
        yield Observation(head.observed_registrations)


@dataclass(frozen=True)
class _HeadInstruments:
    probe_duration: Histogram
    status_changes: Any
    rpc_duration: Histogram
    bad_requests: Any


@functools.cache
def _instruments() -> _HeadInstruments:
    """Made once per process, on the first head or the first probe (the provider is in place by then)."""
    m = meter()
    m.create_observable_gauge(
        "gym.server.up", [_up], unit="1", description="1 when the server's last probe succeeded"
    )
    m.create_observable_gauge(
        "gym.server.instances",
        [_instances],
        unit="{instance}",
        description="a server's instances by state: up, draining, down, pending",
    )
    m.create_observable_gauge(
        "gym.head.revision", [_revision], description="the status revision watches resume from"
    )
    m.create_observable_gauge(
        "gym.instance.up",
        [_instance_up],
        unit="1",
        description="1 while an instance answers its probe and is not draining (capped per head)",
    )
    m.create_observable_gauge(
        "gym.instance.in_flight",
        [_instance_in_flight],
        unit="{request}",
        description="calls in flight a registered instance's process reported at its last renewal",
    )
    m.create_observable_counter(
        "gym.instance.downs",
        [_instance_downs],
        unit="{ejection}",
        description="times an instance stopped answering its probe (the head took it out of the healthy set)",
    )
    m.create_observable_gauge(
        "gym.head.instance_series_dropped",
        [_series_dropped],
        unit="{instance}",
        description="instances past the per-instance series cap, not exported one by one",
    )
    m.create_observable_gauge("gym.head.watchers", [_watchers], unit="{watch}", description="open status watches")
    m.create_observable_gauge(
        "gym.head.registrations", [_registrations], unit="{instance}", description="registered server instances"
    )
    return _HeadInstruments(
        probe_duration=seconds_histogram(
            "gym.probe.duration", "how long status probes took, by server and result", PROBE_BUCKETS
        ),
        status_changes=m.create_counter(
            "gym.server.status_changes", unit="{change}", description="status changes seen by the prober"
        ),
        rpc_duration=seconds_histogram(
            "rpc.server.call.duration",
            "control-plane RPCs served, by method and status code (count: the _count series)",
            RPC_BUCKETS,
        ),
        bad_requests=m.create_counter(
            "gym.head.bad_requests",
            unit="{request}",
            description="requests to an HTTP-side port (the HTTP head, metrics) that did not parse, by port",
        ),
    )


def probe_recorded(name: str, instance: InstanceReport) -> None:
    if instance.status is None:
        return
    _instruments().probe_duration.record(
        instance.latency_seconds, {SERVER_NAME: name, SERVER_STATUS: instance.status}
    )


def bad_request(port: str) -> None:
    """A request to an HTTP-side port that did not parse (gym_rpc.server.observability._quiet_http_log)."""
    _instruments().bad_requests.add(1, {"gym.port": port})


def status_changed(name: str, before: str, after: str) -> None:
    _instruments().status_changes.add(1, {SERVER_NAME: name, "gym.status.from": before, "gym.status.to": after})


# --- gRPC server RPC duration and count --------------------------------------------------------------------------


def _record_rpc(method: str, started: float, code: grpc.StatusCode) -> None:
    service, _, name = method.lstrip("/").rpartition("/")
    _instruments().rpc_duration.record(
        time.perf_counter() - started,
        {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "rpc.grpc.status_code": code.value[0]},
    )


def _code_of(context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None) -> grpc.StatusCode:
    """The call's status: what the handler set or aborted with; UNKNOWN for an escaped exception, CANCELLED when
    the caller went away."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if error is None:
        return grpc.StatusCode.OK
    return grpc.StatusCode.UNKNOWN if isinstance(error, Exception) else grpc.StatusCode.CANCELLED


@contextlib.contextmanager
def _timed(method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Iterator[None]:
    """Record the call's duration and status code when the block ends, however it ends."""
    started, error = time.perf_counter(), None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        _record_rpc(method, started, _code_of(context, error))


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Times every unary and server-streaming call of the head (`rpc.server.call.duration`, seconds)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        if handler.unary_unary is not None:
            inner_unary: Any = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                with _timed(method, context):
                    return await inner_unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream: Any = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                with _timed(method, context):
                    async for message in inner_stream(request, context):
                        yield message

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:  # a coroutine that writes with context.write (grpc's health Watch)
            inner_writer: Any = handler.unary_stream

            async def writer(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
                # _timed's rule, spelled out: a watch stream held open holds no context manager object.
                started = time.perf_counter()
                try:
                    await inner_writer(request, context)
                except BaseException as exc:
                    _record_rpc(method, started, _code_of(context, exc))
                    raise
                _record_rpc(method, started, _code_of(context, None))

            return grpc.unary_stream_rpc_method_handler(
                writer, handler.request_deserializer, handler.response_serializer
            )
        return handler
