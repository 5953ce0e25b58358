"""A server's instances as the head reports them: what the config and the registry say of each one (its
InstanceTarget), and the server's one report made from its instances' probe results.

A server has one or more instances: the config entry's own address, the static replicas it lists, and the
processes that registered at addresses of their own. Each is probed on its own; the server's report keeps what a
client of one instance has always read from it: `url` is the config instance's, `status` is SUCCESS when any
instance that is not draining answers (else the config instance's own status), and the probe fields come from the
instance that status comes from. The standard health service says SERVING for the name when an instance that is not
draining answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gym_rpc.config import ServerEntry
from gym_rpc.wire import InstanceReport, RegistrationState, ServerStatus, StatusReport

UP = "success"


@dataclass(frozen=True)
class InstanceTarget:
    """One instance to probe and report, as the config and the registry describe it: its report before any probe,
    and where its registration said clients reach it ("" when not registered)."""

    unprobed: InstanceReport
    advertised_url: str = ""

    @property
    def instance_id(self) -> str:
        """The authority of `url` (gym_rpc.config.InstanceAddress.instance_id)."""
        return self.unprobed.instance_id

    @property
    def url(self) -> str:
        return self.unprobed.url

    def report(self, probed: InstanceReport | None = None) -> InstanceReport:
        """The instance's report: with the probe fields of `probed` when it was probed at this URL."""
        if probed is None or probed.url != self.url:
            return self.unprobed
        return with_probe(self.unprobed, probed)

    def with_registration(self, registration: RegistrationState | None) -> InstanceTarget:
        """This target with `registration` (why its last registration ended, or None)."""
        return dataclasses.replace(self, unprobed=dataclasses.replace(self.unprobed, registration=registration))


def config_targets(entry: ServerEntry) -> tuple[InstanceTarget, ...]:
    """The instances the config names, none registered: the entry's own address, then its static replicas."""
    own, *replicas = entry.instances
    return (
        InstanceTarget(InstanceReport(own.instance_id, own.url, origin="config")),
        *(InstanceTarget(InstanceReport(r.instance_id, r.url, origin="static_replica")) for r in replicas),
    )


def with_probe(instance: InstanceReport, probe: StatusReport | InstanceReport) -> InstanceReport:
    """`instance` with the result of a probe of its URL (the probe fields are the same in both types)."""
    return dataclasses.replace(
        instance,
        status=probe.status,
        detail=probe.detail,
        http_status=probe.http_status,
        latency_seconds=probe.latency_seconds,
        checked_at=probe.checked_at,
    )


# Registrations that ended: clients send such an instance no work
# (gym_rpc.client.replicas._instance_state.GONE_REGISTRATIONS).
GONE: frozenset[RegistrationState | None] = frozenset({"deregistered", "expired"})
# The server's status when instances answer but none may be given work: what clients find there (no instance).
NOT_SERVING_STATUS: ServerStatus = "unknown_error"


def open_for_work(instance: InstanceReport) -> bool:
    """Whether clients may send the instance new work: it answers, is not draining, and its process's
    registration did not end (what clients route by)."""
    return instance.status == UP and not instance.draining and instance.registration not in GONE


def serving_instance(instances: Sequence[InstanceReport]) -> InstanceReport | None:
    """The first instance that may be given new work."""
    return next((i for i in instances if open_for_work(i)), None)


def server_report(name: str, instances: tuple[InstanceReport, ...], advertised_url: str) -> StatusReport:
    """The server's report from its instances (the config instance first): SUCCESS when an instance may be given
    new work, as clients route; the probe fields from that instance (else from the config instance). Instances that
    answer while none may be given work (every one draining, or its registration ended) make the server
    NOT_SERVING_STATUS, saying why: the head's status, health and `gym-rpc status` agree with what clients do."""
    first = instances[0]
    source = serving_instance(instances) or first
    status, detail = source.status, source.detail
    if status == UP and not open_for_work(source):
        status, detail = NOT_SERVING_STATUS, _why_no_work(instances)
    return StatusReport(
        server_name=name,
        status=status,
        url=first.url,
        latency_seconds=source.latency_seconds,
        checked_at=source.checked_at,
        detail=detail,
        http_status=source.http_status,
        registration=first.registration,
        advertised_url=advertised_url,
        instances=instances,
    )


def _why_no_work(instances: Sequence[InstanceReport]) -> str:
    """Why no instance may be given work although one answers: what each answering one is."""
    states = {
        "draining" if i.draining else str(i.registration)
        for i in instances
        if i.status == UP and not open_for_work(i)
    }
    return f"answers, but clients send it no work: every instance is {' or '.join(sorted(states))}"


def watched(report: StatusReport) -> tuple[object, ...]:
    """What status watches follow of a server's report: a change of any of it is one revision. Latencies, probe
    times and failure details move with every probe and are no change; whether a probe's answer was a 5xx is one
    (a client's ejection of an instance ends on a probe answered below 500, never on a 5xx: gym_rpc.client's
    _outliers), its exact code is not."""
    return (*watched_server(report), tuple(watched_instance(i) for i in report.instances))


def watched_server(report: StatusReport) -> tuple[object, ...]:
    """What watches follow of the report's own fields (`watched` without the instances)."""
    return (report.status, report.registration, report.advertised_url)


def watched_instance(i: InstanceReport) -> tuple[object, ...]:
    """What watches follow of one instance."""
    return (
        i.instance_id,
        i.url,
        i.status,
        i.http_status >= 500,
        i.registration,
        i.draining,
        i.labels,
        i.origin,
        i.pid,
        i.start_time,
    )


def serves(report: StatusReport) -> bool | None:
    """Whether the server may be given new work: an instance answers and is not draining. None while nothing is
    known yet (no instance probed). A report without instances (the head's own) goes by its status."""
    if not report.instances:
        return None if report.status is None else report.status == UP
    if serving_instance(report.instances) is not None:
        return True
    return None if report.status is None else False


def instance_label(name: str, instance_id: str, count: int) -> str:
    """How the head's log names an instance: the server's name alone while it has one instance (as before
    replicas), `name instance_id` when it has several."""
    return name if count <= 1 else f"{name} {instance_id}"


def targets_by_name(
    servers: Mapping[str, ServerEntry],
) -> dict[str, tuple[InstanceTarget, ...]]:
    """The config's instances of every server, none registered."""
    return {name: config_targets(entry) for name, entry in servers.items()}
