"""Instances a fresh head has not relearned yet, kept by a worker for a while (issue 40: a restart is invisible).

A head restarted without its registrations file (a bridge, a config given in code), or another head of the list
that missed a registration, sends a snapshot without the registered instances it has not heard from yet. They are
alive and re-register within moments (at once when they see the new head, at their next renewal at the latest), so
a worker that dropped them at that snapshot would move their rollouts, and lose the sessions those held, for
nothing. So an instance the follower knew and a later snapshot leaves out is kept, as it was, for `grace_seconds`
(the registration helper's default lease), merged into every report of its server until the head lists it again
or the grace runs out. The head's own word still wins at once: a change that lists the instance (registered again,
deregistered, expired) ends its grace, and a server the snapshot leaves out altogether (a config reload) keeps
nothing. A kept instance that died meanwhile is ejected by the worker's own failures, as while the head is down.

Only snapshots after the first start a grace: a follower's first snapshot replaces nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from gym_rpc.wire import InstanceReport, StatusReport

# The lease ServerRegistration asks for by default (3 renewals of 10 s): a live instance is back well within it.
DEFAULT_GRACE_SECONDS = 30.0


class RelearnGrace:
    """The instances kept per server, each until its deadline (time.monotonic() values, given by the caller)."""

    def __init__(self, grace_seconds: float | None = None) -> None:
        self.grace_seconds = DEFAULT_GRACE_SECONDS if grace_seconds is None else grace_seconds
        self._kept: dict[str, dict[str, tuple[InstanceReport, float]]] = {}  # server -> instance id -> (it, until)

    def __bool__(self) -> bool:
        return bool(self._kept)

    def kept(self, server_name: str) -> list[str]:
        """The instance ids of `server_name` kept now (tests, logs)."""
        return list(self._kept.get(server_name, {}))

    def snapshot(
        self, known: dict[str, StatusReport], reports: Iterable[StatusReport], now: float
    ) -> list[StatusReport]:
        """A snapshot replacing the view `known`: instances it leaves out of a server it still lists start (or
        keep) their grace; the reports come back with the kept instances merged in."""
        reports = list(reports)
        listed = {report.server_name for report in reports}
        for name in [name for name in self._kept if name not in listed]:
            del self._kept[name]  # the server is gone from the config: nothing of it is kept
        for report in reports:
            before = known.get(report.server_name)
            if before is None or not report.instances:
                continue
            present = {instance.instance_id for instance in report.instances}
            kept = self._kept.setdefault(report.server_name, {})
            for instance in before.instances:
                if instance.instance_id not in present and instance.instance_id not in kept:
                    kept[instance.instance_id] = (instance, now + self.grace_seconds)
        return self.merged(reports, now)

    def merged(self, reports: Iterable[StatusReport], now: float) -> list[StatusReport]:
        """`reports` (a change's, or a snapshot's) with each server's kept instances added; an instance a report
        lists again, or whose grace ran out, is no longer kept."""
        out = []
        for report in reports:
            kept = self._kept.get(report.server_name)
            if kept is None or not report.instances:
                out.append(report)
                continue
            for instance in report.instances:
                kept.pop(instance.instance_id, None)  # the head lists it: its word from now on
            extra = [instance for instance, until in kept.values() if until > now]
            if len(extra) < len(kept):
                self._kept[report.server_name] = {
                    instance.instance_id: (instance, until) for instance, until in kept.values() if until > now
                }
            if not self._kept[report.server_name]:
                del self._kept[report.server_name]
            out.append(dataclasses.replace(report, instances=(*report.instances, *extra)) if extra else report)
        return out

    def next_expiry(self) -> float | None:
        """When the earliest grace runs out (None: nothing kept)."""
        return min((until for kept in self._kept.values() for _, until in kept.values()), default=None)

    def expired(self, known: dict[str, StatusReport], now: float) -> list[StatusReport]:
        """The reports of the servers whose kept instances ran out by `now`, without them (the view to push)."""
        out = []
        for name in list(self._kept):
            kept = self._kept[name]
            if all(until > now for _, until in kept.values()):
                continue
            gone = {instance_id for instance_id, (_, until) in kept.items() if until <= now}
            report = known.get(name)
            if report is not None:
                left = tuple(instance for instance in report.instances if instance.instance_id not in gone)
                out.append(dataclasses.replace(report, instances=left))
            for instance_id in gone:
                del kept[instance_id]
            if not kept:
                del self._kept[name]
        return out
