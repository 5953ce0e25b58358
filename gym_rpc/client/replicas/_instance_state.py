"""The instances (replicas) of one server as a client sees them: where each listens and what the head says of it
(probe status, draining, labels), beside what the client learns itself (calls in flight, failures, ejections).

An `Instance` lives as long as its address is in the server's set: a report from the head updates it in place, so
the client's own counts survive every change the watch pushes. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from gym_rpc.client.replicas._picker import stable_key
from gym_rpc.config import ServerEntry, url_authority
from gym_rpc.wire import InstanceOrigin, InstanceReport, RegistrationState, ServerStatus, StatusReport

# What the head's probe says when nothing answers there usefully: such an instance gets no calls. An instance not
# probed yet (None) does: a replica that just registered listens already, and must get calls within a second.
DOWN_STATUSES: frozenset[ServerStatus | None] = frozenset({"connection_error", "timeout", "unknown_error"})
# Registrations that ended: the process stopped (deregistered) or stopped renewing its lease (expired).
GONE_REGISTRATIONS: frozenset[RegistrationState | None] = frozenset({"deregistered", "expired"})


@dataclass(frozen=True)
class InstanceState:
    """What the head (or the config) says of one instance, as the client applies it."""

    instance_id: str
    url: str
    status: ServerStatus | None = None
    checked_at: float = 0.0
    draining: bool = False
    labels: Mapping[str, str] | None = None
    registration: RegistrationState | None = None
    origin: InstanceOrigin | None = None
    http_status: int = 0  # the code the head's last probe got; 0 when none came (or an older head)


# What a route is told of an instance: the head's own report of it as it came (its fields are InstanceState's,
# and more), or an InstanceState the client put together (the config's instances, ListServerInstances rows).
InstanceView = InstanceState | InstanceReport


class Instance:
    """One instance of a server: the head's view of it (`apply`) and the client's own counts.

    `alive` (not down by the head's probe, not ejected) says whether calls may go there at all; `fresh` (alive, not
    draining) whether new work may. The route recomputes both when anything they depend on changes.
    """

    __slots__ = (
        "alive",
        "candidate",
        "checked_at",
        "consecutive_failures",
        "draining",
        "ejected_checked_at",
        "ejected_for_connect",
        "ejected_until",
        "ejection_level",
        "ejections",
        "engine_load",
        "http_status",
        "in_flight",
        "instance_id",
        "key",
        "labels",
        "last_ejection_ended",
        "last_failure",
        "latency",
        "latency_at",
        "left_at",
        "on_probation",
        "origin",
        "own_peak",
        "own_peak_at",
        "picks",
        "registration",
        "repins_logged",
        "slow",
        "slow_at",
        "status",
        "url",
    )

    def __init__(self, state: InstanceView) -> None:
        self.instance_id = state.instance_id
        self.key = stable_key(state.instance_id)
        self.url = state.url
        self.status: ServerStatus | None = None
        self.checked_at = 0.0
        self.http_status = 0
        self.draining = False
        self.labels: Mapping[str, str] = {}
        self.registration: RegistrationState | None = None
        self.origin: InstanceOrigin | None = None
        self.in_flight = 0  # calls sent here whose answer (headers) has not come yet
        # Requests the engine reports waiting and running (its /metrics, as the head reads and pushes them) beyond
        # this process's own calls there (the most it had lately, `own_peak`), for a model server's prefix-affine
        # picking; 0 while unknown (the calls in flight then stand alone).
        self.engine_load = 0
        # The most calls this process had here within OWN_PEAK_SECONDS (and when), as each model call sent here
        # and each read of the engines' load counts them: a figure the head read while they ran counts them all,
        # so all are taken off it. Counted at the reads alone, which come with picks (a call just answered, the
        # next not sent yet), it missed one, and a phantom call of another worker sent a group off its home.
        self.own_peak = 0
        self.own_peak_at = 0.0
        # When this process's last model call here was answered with none left in flight (0.0: never): a figure
        # the head read after that counts none of this process's calls; and a worker's next group goes where its
        # last one just ended (its `home`, prefix-affine picking).
        self.left_at = 0.0
        # A model server's calls' time to their answers' headers as this process saw them (an EWMA; 0.0: none yet),
        # when the last came, whether that makes it slow against the others (prefix-affine picking), and when a
        # read of the loads last judged it so: the verdict stands until an answer from it comes after that, or its
        # figure is forgotten (the others answering slower since, under more load, do not clear it).
        self.latency = 0.0
        self.latency_at = 0.0
        self.slow = False
        self.slow_at = 0.0
        self.picks = 0  # calls (and resends) sent here, for the worker metrics
        self.consecutive_failures = 0
        self.last_failure = ""
        self.ejections = 0  # times ejected, for the worker metrics
        self.ejection_level = 0  # how many ejections in a row the next one's length grows by
        self.ejected_until = 0.0  # time.monotonic() at which an ejection ends; 0: not ejected
        self.ejected_checked_at = 0.0  # the head's probe time when ejected: a newer healthy probe may end it
        self.ejected_for_connect = False  # ejected by failures to connect, which the head's probe tests too
        self.on_probation = False  # back from an ejection: its next failure ejects it again, a success ends this
        self.last_ejection_ended = 0.0
        self.repins_logged = False  # one log line when rollouts first move off this instance
        self.alive = True
        self.candidate = False  # in its route's pool of instances that take new work
        self.apply(state)

    def apply(self, state: InstanceView) -> None:
        self.url = state.url
        self.status = state.status
        self.checked_at = state.checked_at
        self.http_status = state.http_status
        self.draining = state.draining
        if state.labels is not None:
            self.labels = dict(state.labels)
        self.registration = state.registration
        self.origin = state.origin

    @property
    def down(self) -> bool:
        """Whether the head says nothing answers there (or the process's registration ended)."""
        return self.status in DOWN_STATUSES or self.registration in GONE_REGISTRATIONS

    def ejected(self, now: float) -> bool:
        return self.ejected_until > now

    def describe(self, now: float) -> str:
        """Its last status, as an error names it."""
        if self.ejected(now):
            return (
                f"ejected for {self.ejected_until - now:.0f} s more after {self.consecutive_failures} failures "
                f"in a row ({self.last_failure})"
            )
        if self.registration in GONE_REGISTRATIONS:
            return str(self.registration)
        parts: list[str] = [self.status or "not probed yet"]
        if self.draining:
            parts.append("draining")
        if self.labels:
            parts.append(",".join(f"{k}={v}" for k, v in sorted(self.labels.items())))
        return " ".join(parts)


def config_states(entry: ServerEntry) -> list[InstanceState]:
    """The instances the config names for a server: its own address first, then its static replicas."""
    return [
        InstanceState(address.instance_id, address.url, origin="config" if index == 0 else "static_replica")
        for index, address in enumerate(entry.instances)
    ]


def report_states(report: StatusReport) -> list[InstanceView]:
    """The instances a head's report lists, as the report has them (one without an id by its URL's authority).
    A head older than replicas lists none: the route's `apply_reports` takes the report itself for its one."""
    return [
        instance if instance.instance_id else replace(instance, instance_id=url_authority(instance.url))
        for instance in report.instances
    ]


def matches(labels: Mapping[str, str], selector: Mapping[str, str] | None) -> bool:
    """Whether an instance's labels carry every key of `selector` with the same value (None: any instance)."""
    return selector is None or all(labels.get(key) == value for key, value in selector.items())


def selector_text(selector: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(selector.items()))


def distinct(states: Iterable[InstanceView]) -> list[InstanceView]:
    """The states with one per instance id, the first kept (a config listing an address twice is refused by the
    config; a head may still send what it sends)."""
    seen: set[str] = set()
    kept = []
    for state in states:
        if state.instance_id not in seen:
            seen.add(state.instance_id)
            kept.append(state)
    return kept
