"""ServerClient's metrics, recorded only while `gym_rpc.metrics.METRICS.enabled` (ServerClient.request checks it
once per call; off, nothing here runs).

OpenTelemetry names (Prometheus names in README "Metrics"): `http.client.request.duration` (seconds, by server,
method and status code or error type), `http.client.active_requests` (calls in flight, by server),
`gym.client.resends` (attempts after a failed one, by the failure's kind), `gym.client.given_up` (calls given up
after their resends, by the last failure's kind and what ran out) and `gym.client.unreachable` (calls given up on
an unreachable server). Per instance of a replicated server (gym_rpc.client.replicas._routing):
`gym.client.instance.picks`, `.active_requests` and `.ejections`, and per server `gym.client.rollout.repins`, read
from the routes' own counts when a reader collects (the calls pay an integer addition, metrics on or off).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation

from gym_rpc.client.replicas import ROUTINGS
from gym_rpc.errors import ResendsExhaustedError, ServerUnreachableError
from gym_rpc.metrics import meter, seconds_histogram
from gym_rpc.telemetry import instrumentation_failed

if TYPE_CHECKING:
    import aiohttp

    from gym_rpc.client.replicas import Instance

SERVER_NAME = "gym.server.name"
INSTANCE_ID = "gym.server.instance.id"  # the instance's `host:port` (InstanceReport.instance_id)
FAILURE_KIND = "gym.failure.kind"  # refused, dropped_before_write, dropped_after_write, timeout
# What ended a call's resends: attempts, time, deadline, client budget, no resend.
RESEND_LIMIT = "gym.resend.limit"
# Seconds: from a loopback call (a millisecond) to a long model generation (minutes).
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class _ClientInstruments:
    duration: Histogram
    resends: Counter
    given_up: Counter
    unreachable: Counter


# Calls in flight per (server, method), counted here and observed when a reader collects: two SDK measurements per
# call (each cleans and hashes its attributes) would cost as much as the duration's. A lock, as clients on
# several event loops (threads) share the counts.
_in_flight: dict[tuple[str, str], int] = {}
_in_flight_lock = threading.Lock()


def _observe_in_flight(options: CallbackOptions) -> Iterable[Observation]:
    with _in_flight_lock:
        counts = list(_in_flight.items())
    return [Observation(count, _attributes(*key)) for key, count in counts]


def _per_instance(count: Callable[[Instance], int]) -> Callable[[CallbackOptions], Iterable[Observation]]:
    """A callback observing `count` of every instance of every replicated server, summed over the process's
    clients (two clients of one head route to the same instances)."""

    def observe(options: CallbackOptions) -> Iterable[Observation]:
        totals: dict[tuple[str, str], int] = {}
        for routing in list(ROUTINGS):
            for name, route in list(routing.routes.items()):
                for instance in route.instances:
                    key = (name, instance.instance_id)
                    totals[key] = totals.get(key, 0) + count(instance)
        return [Observation(value, {SERVER_NAME: name, INSTANCE_ID: iid}) for (name, iid), value in totals.items()]

    return observe


def _observe_repins(options: CallbackOptions) -> Iterable[Observation]:
    totals: dict[str, int] = {}
    for routing in list(ROUTINGS):
        for name, route in list(routing.routes.items()):
            totals[name] = totals.get(name, 0) + route.repins
    return [Observation(value, {SERVER_NAME: name}) for name, value in totals.items()]


def _instance_instruments(m: Meter) -> None:
    m.create_observable_counter(
        "gym.client.instance.picks",
        [_per_instance(lambda instance: instance.picks)],
        unit="{attempt}",
        description="attempts sent to each instance of a replicated server",
    )
    m.create_observable_up_down_counter(
        "gym.client.instance.active_requests",
        [_per_instance(lambda instance: instance.in_flight)],
        unit="{request}",
        description="calls in flight at each instance of a replicated server",
    )
    m.create_observable_counter(
        "gym.client.instance.ejections",
        [_per_instance(lambda instance: instance.ejections)],
        unit="{ejection}",
        description="times each instance was ejected after failures in a row",
    )
    m.create_observable_counter(
        "gym.client.rollout.repins",
        [_observe_repins],
        unit="{rollout}",
        description="rollouts moved off an instance that was gone",
    )


@functools.cache
def _instruments() -> _ClientInstruments:
    """Made on the first metered call, from the MeterProvider in place by then."""
    m = meter()
    m.create_observable_up_down_counter(
        "http.client.active_requests",
        [_observe_in_flight],
        unit="{request}",
        description="ServerClient calls in flight",
    )
    _instance_instruments(m)
    return _ClientInstruments(
        duration=seconds_histogram(
            "http.client.request.duration",
            "ServerClient calls, from sending to the response headers, resends included",
            DURATION_BUCKETS,
        ),
        resends=m.create_counter(
            "gym.client.resends",
            unit="{attempt}",
            description="attempts after a failed one, by its kind of failure",
        ),
        given_up=m.create_counter(
            "gym.client.given_up",
            unit="{request}",
            description="calls given up after their resends, by the last failure's kind and what ran out",
        ),
        unreachable=m.create_counter(
            "gym.client.unreachable", unit="{request}", description="calls given up on an unreachable server"
        ),
    )


@functools.lru_cache(maxsize=4096)
def _attributes(server_name: str, method: str) -> Mapping[str, str]:
    """Shared (never mutated) per server and method, so a call builds no dict for its in-flight count."""
    return {SERVER_NAME: server_name, "http.request.method": method.upper()}


@functools.lru_cache(maxsize=4096)
def _failure_attributes(server_name: str, method: str, kind: str, limit: str | None) -> Mapping[str, str]:
    attributes = {**_attributes(server_name, method), FAILURE_KIND: kind}
    if limit is not None:
        attributes[RESEND_LIMIT] = limit
    return attributes


@functools.lru_cache(maxsize=4096)
def _outcome_attributes(server_name: str, method: str, outcome: int | str) -> Mapping[str, Any]:
    key = "http.response.status_code" if isinstance(outcome, int) else "error.type"
    return {**_attributes(server_name, method), key: outcome}


class MeteredCall:
    """The CallObserver of a call while worker metrics are on: in flight from its making, its resends and a give-up
    counted, its duration recorded at its answer or error. Told from inside `send`, so metering adds no coroutine
    between the caller and aiohttp."""

    __slots__ = ("attributes", "instruments", "key", "started")
    kind = "metrics"  # what instrumentation_failed logs its failures under

    def __init__(self, server_name: str, method: str) -> None:
        self.instruments = _instruments()
        self.key = key = (server_name, method)
        self.attributes = _attributes(server_name, method)
        with _in_flight_lock:
            _in_flight[key] = _in_flight.get(key, 0) + 1
        self.started = time.perf_counter()

    def resent(self, attempt: int, kind: str) -> None:
        self.instruments.resends.add(1, _failure_attributes(*self.key, kind, None))

    def answered(self, response: aiohttp.ClientResponse, attempts: int) -> None:
        self._ended(response.status)

    def failed(self, error: BaseException, attempts: int) -> None:
        if isinstance(error, ResendsExhaustedError):
            self.instruments.given_up.add(1, _failure_attributes(*self.key, error.kind, error.limit))
            if isinstance(error, ServerUnreachableError):
                self.instruments.unreachable.add(1, self.attributes)
        self._ended(type(error).__qualname__)

    def _ended(self, outcome: int | str) -> None:
        with _in_flight_lock:
            _in_flight[self.key] -= 1
        self.instruments.duration.record(
            time.perf_counter() - self.started, _outcome_attributes(*self.key, outcome)
        )


def metered_call(server_name: str, method: str) -> MeteredCall | None:
    """The observer of a metered call, counted in flight from here: the call must be sent at once. Metrics that
    fail to start (an instrument that cannot be made) leave the call unmetered, and logged."""
    try:
        return MeteredCall(server_name, method)
    except Exception as error:
        instrumentation_failed(MeteredCall.kind, error)
        return None
