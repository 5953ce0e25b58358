"""The head's background prober: probes every instance of every server concurrently, caches the results, and
keeps the watch history.

Borrowed from etcd and xDS: every status change bumps one rising revision, a bounded history of changes lets a
watch resume from the last revision it saw, and a resume older than the history gets a fresh snapshot.

Probes are single-flight (as Go's singleflight and Envoy's health checker merge them): every probe of an instance,
background or on demand, goes through one in-flight task per instance that concurrent callers share, and a result
younger than the freshness window is served from the cache. So a thousand pollers of one server cost each of its
instances at most one probe per window, not a thousand.

A server's instances (gym_rpc.server.fleet._server_instances) are given by the registry (`set_targets`): any change
to one of them (added, removed, its status, registration, draining flag or labels) is a change of the server's
report, one revision. Freshness is judged on time.monotonic(), never on the shown `checked_at`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from gym_rpc._tasks import cancel_and_wait, run_every
from gym_rpc._version import __version__
from gym_rpc.config import ServerEntry
from gym_rpc.server.fleet import events as events
from gym_rpc.server.fleet._pushes import DEFAULT_MAX_DELAY_SECONDS, DEFAULT_QUIET_SECONDS, Pushes
from gym_rpc.server.fleet._server_instances import (
    InstanceTarget,
    server_report,
    targets_by_name,
    watched,
    watched_instance,
    watched_server,
    with_probe,
)
from gym_rpc.wire import TRACEPARENT_HEADER, InstanceReport, ServerStatus, StatusReport

logger = logging.getLogger("gym_rpc.server._prober")  # its name from before the move

PROBE_USER_AGENT = f"gym-rpc-probe/{__version__}"
AIOHTTP_INSTRUMENTATION_MODULE = "opentelemetry.instrumentation.aiohttp_client"

ChangeListener = Callable[[StatusReport | None, str], Awaitable[None]]


# Probes in flight at once: per head (descriptors: gym_rpc.server.security._connection_limits.OTHER_FD_RESERVE
# keeps them), and per server, so one server's mute instances (each holding its slot for the whole probe timeout)
# can take at most its own share and never delay another server's probes.
MAX_PROBES_IN_FLIGHT = 100
PROBES_PER_SERVER = 8


def new_probe_session(max_connections: int = MAX_PROBES_IN_FLIGHT) -> aiohttp.ClientSession:
    """A session for probes: a fresh connection per probe (a pooled one would hide a restarted or dead
    server behind a stale socket), no proxies, no cookies, and never traced by aiohttp's OpenTelemetry
    instrumentation (a span, and a sampled trace on the server, every probe round would bury real traces)."""
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=True)
    session = aiohttp.ClientSession(
        connector=connector,
        trust_env=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        headers={"User-Agent": PROBE_USER_AGENT},
    )
    instrumentation = sys.modules.get(AIOHTTP_INSTRUMENTATION_MODULE)
    if instrumentation is not None:
        instrumentation.AioHttpClientInstrumentor.uninstrument_session(session)
    return session


def unsampled_traceparent() -> str:
    """A W3C traceparent whose sampled flag is off: a traced server continues it without recording anything (the
    default ParentBased sampler), where a probe without one would start a sampled trace of its own."""
    trace_id, span_id = secrets.randbits(128) or 1, secrets.randbits(64) or 1
    return f"00-{trace_id:032x}-{span_id:016x}-00"


async def probe(session: aiohttp.ClientSession, server_name: str, url: str, timeout: float) -> StatusReport:
    """GET the server's base URL. Any HTTP answer, a 500 or a redirect (never followed) included, is success (as
    NeMo Gym does)."""
    started = time.monotonic()
    status: ServerStatus
    http_status = 0
    detail = ""
    try:
        async with session.get(
            url,
            allow_redirects=False,  # a redirect is an answer: following it would probe an address no one allowed
            timeout=aiohttp.ClientTimeout(total=max(timeout, 0.001)),
            headers={TRACEPARENT_HEADER: unsampled_traceparent()},
        ) as response:
            http_status = response.status
        status = "success"
    except aiohttp.ClientConnectorError as exc:
        status, detail = "connection_error", str(exc.os_error or exc)
    except (TimeoutError, aiohttp.ServerTimeoutError):
        status, detail = "timeout", f"no answer within {timeout:.3g}s"
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        status, detail = "unknown_error", f"{type(exc).__name__}: {exc}"
    return StatusReport(
        server_name=server_name,
        status=status,
        url=url,
        latency_seconds=time.monotonic() - started,
        checked_at=time.time(),
        detail=detail,
        http_status=http_status,
    )


@dataclass(frozen=True)
class Changes:
    """What a watcher needs after `since`: either the changed reports, or a snapshot when history is gone."""

    revision: int
    reports: list[StatusReport]
    compacted: bool


def changes_in_history(
    history: deque[tuple[int, StatusReport]],
    current: int,
    revision: int,
    until: int | None,
    snapshot: Callable[[], list[StatusReport]],
) -> Changes:
    """What a watcher at `revision` has not seen up to `until` (None: `current`), from a bounded history of
    (revision, report): the latest report of each changed server, or a compacted `snapshot()` of now when the
    history no longer reaches back to `revision`. The prober and the watch relay's mirror each keep one."""
    top = current if until is None else min(until, current)
    if revision >= top:
        return Changes(top, [], compacted=False)
    oldest = history[0][0] if history else current + 1
    if revision < oldest - 1:
        return Changes(current, snapshot(), compacted=True)
    latest: dict[str, StatusReport] = {}
    for rev, report in history:
        if revision < rev <= top:
            latest[report.server_name] = report
    return Changes(top, list(latest.values()), compacted=False)


@dataclass
class _Server:
    """One server as the prober holds it: its instances' targets and reports (in the registry's order), when each
    was last probed (time.monotonic()), and the server's report made from them."""

    targets: dict[str, InstanceTarget]
    instances: dict[str, InstanceReport]
    composed: StatusReport  # the server's report as last made from its instances
    probed_at: dict[str, float] = field(default_factory=dict)
    in_status: dict[str, int] = field(default_factory=dict)  # probes in a row that gave the current status
    # A probe that changed no status leaves the report to be made when it is next read: a probe costs O(1),
    # not a walk over every instance of its server (a server of N instances would cost O(N^2) a round).
    stale: bool = False

    @classmethod
    def of(cls, name: str, targets: Sequence[InstanceTarget]) -> _Server:
        server = cls(targets={}, instances={}, composed=StatusReport(server_name=name, status=None, url=""))
        server.retarget(name, targets)
        return server

    @property
    def report(self) -> StatusReport:
        """The server's report from its instances' latest results."""
        if self.stale:
            self.compose(self.composed.server_name)
        return self.composed

    def retarget(self, name: str, targets: Sequence[InstanceTarget]) -> bool:
        """Follow the instances the registry gives; True when the server's report changed (an instance came, left,
        or changed what the registry says of it). An instance at the same URL keeps its probe result."""
        if not targets:
            raise ValueError(f"server {name!r} needs at least one instance")
        old = self.instances
        self.targets = {t.instance_id: t for t in targets}
        self.instances = {t.instance_id: t.report(old.get(t.instance_id)) for t in targets}
        for instance_id in [i for i in self.probed_at if i not in self.instances]:
            del self.probed_at[instance_id]  # it left: probed afresh if it comes back
            self.in_status.pop(instance_id, None)
        return self.compose(name)

    def compose(self, name: str, changed: InstanceReport | None = None) -> bool:
        """Make the server's report from its instances; True when what watches follow of it changed. `changed`:
        the previous report of the one instance that changed (the others did not), so only it is compared."""
        report = server_report(name, tuple(self.instances.values()), self.config_target.advertised_url)
        if changed is None:
            differs = watched(report) != watched(self.composed)
        else:
            now = self.instances.get(changed.instance_id)
            differs = (
                len(report.instances) != len(self.composed.instances)
                or watched_server(report) != watched_server(self.composed)
                or now is None
                or watched_instance(now) != watched_instance(changed)
            )
        self.composed, self.stale = report, False
        return differs

    def retarget_one(self, name: str, target: InstanceTarget) -> bool:
        """Follow one instance the registry changed or added (added last, as the registry orders them); True when
        the server's report changed. O(1) but for making the report (a tuple of the instances)."""
        instance_id = target.instance_id
        old = self.instances.get(instance_id)
        self.targets[instance_id] = target
        self.instances[instance_id] = target.report(old)
        if old is None:
            return self.compose(name)
        if old.url != target.url:
            self.probed_at.pop(instance_id, None)
            self.in_status.pop(instance_id, None)
        return self.compose(name, old)

    def drop(self, name: str, instance_id: str) -> bool:
        """Forget one instance the registry removed; True when the server's report changed."""
        if instance_id not in self.instances or len(self.instances) == 1:
            return False
        del self.targets[instance_id], self.instances[instance_id]
        self.probed_at.pop(instance_id, None)
        self.in_status.pop(instance_id, None)
        return self.compose(name)

    @property
    def config_target(self) -> InstanceTarget:
        return next(iter(self.targets.values()))

    def is_fresh(self, instance_id: str, max_age_seconds: float) -> bool:
        probed_at = self.probed_at.get(instance_id)
        return max_age_seconds > 0 and probed_at is not None and time.monotonic() - probed_at <= max_age_seconds


class StatusProber:
    """Probes every instance of every server on an interval; the single writer of the status cache and its
    revision."""

    def __init__(
        self,
        servers: Mapping[str, ServerEntry],
        *,
        interval_seconds: float = 2.0,
        probe_timeout_seconds: float = 1.0,
        history_size: int = 1024,
        on_change: ChangeListener | None = None,
        default_max_age_seconds: float | None = None,
        push_quiet_seconds: float = DEFAULT_QUIET_SECONDS,
        push_max_delay_seconds: float = DEFAULT_MAX_DELAY_SECONDS,
    ) -> None:
        self.interval_seconds = interval_seconds
        self.probe_timeout_seconds = probe_timeout_seconds
        # How old a cached result may be when a caller states no freshness bound: half the interval by default,
        # so the background round and on-demand probes together stay near one probe per window.
        self.default_max_age_seconds = (
            default_max_age_seconds if default_max_age_seconds is not None else interval_seconds / 2
        )
        self.config_version = ""  # the head's config version, sent on every watch message
        self.probes_started = 0  # probes actually sent (a shared probe counts once)
        self.probes_joined = 0  # callers that shared a probe already in flight instead of starting one
        self.rounds = 0  # background probe rounds finished (the head is not ready before the first)
        # (server name, instance id) -> (url, probe task)
        self._in_flight: dict[tuple[str, str], tuple[str, asyncio.Task[InstanceReport]]] = {}
        # Start at the wall clock in milliseconds, so revisions keep rising across head restarts and a watch
        # resuming with a revision issued by an earlier head is never mistaken for one from this head's history.
        self.revision = time.time_ns() // 1_000_000
        self._servers: dict[str, _Server] = {}
        self._history: deque[tuple[int, StatusReport]] = deque(maxlen=history_size)
        self._next_change: asyncio.Future[None] | None = None  # made by the first waiter, in its running loop
        self._on_change = on_change
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending_servers = servers
        self._server_slots: dict[str, asyncio.Semaphore] = {}
        self._slots = asyncio.Semaphore(MAX_PROBES_IN_FLIGHT)
        # What watchers are told, and when: changes close together are pushed as one
        # (gym_rpc.server.fleet._pushes).
        self.pushes = Pushes(
            lambda: self.revision, quiet_seconds=push_quiet_seconds, max_delay_seconds=push_max_delay_seconds
        )

    async def start(self) -> None:
        self._session = new_probe_session(MAX_PROBES_IN_FLIGHT)
        self._slots = asyncio.Semaphore(MAX_PROBES_IN_FLIGHT)  # the connector never queues: a probe's timeout
        # counts from when it holds its slots, so waiting for one is never a timeout
        if not self._servers:  # the registry may have given the instances already
            await self.set_servers(self._pending_servers)
        self._task = asyncio.create_task(self._run(), name="gym_rpc status prober")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self.pushes.close()
        for _, task in list(self._in_flight.values()):
            await cancel_and_wait(task)
        self._in_flight.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def set_servers(self, servers: Mapping[str, ServerEntry]) -> None:
        """Follow a (re)loaded config with no registrations: every server's config instances (gym_rpc.server.
        _registry gives the registered ones with `set_targets`)."""
        await self.set_targets(targets_by_name(servers))

    async def set_targets(self, servers: Mapping[str, Sequence[InstanceTarget]]) -> None:
        """Follow the servers and their instances: new servers and instances start unprobed, removed ones leave,
        and each server whose report changed is one revision."""
        removed = [n for n in self._servers if n not in servers]
        for name in removed:
            del self._servers[name]
            await self._notify(None, name)
        if removed:  # a removal is no report: drop the history so every watcher gets a fresh snapshot
            self._history.clear()
            self._bump()
        for name, targets in servers.items():
            if name in self._servers:
                await self.set_instances(name, targets)
            else:
                server = self._servers[name] = _Server.of(name, targets)
                self._record(server.report)
                await self._notify(server.report, name)

    async def set_instances(self, name: str, targets: Sequence[InstanceTarget]) -> None:
        """Follow one server's instances (after a registration); a change of its report is one revision. A server
        the prober does not have (not in the config) is ignored."""
        server = self._servers.get(name)
        if server is not None and server.retarget(name, targets):
            self._record(server.report)
            await self._notify(server.report, name)

    async def set_instance(self, name: str, target: InstanceTarget) -> None:
        """Follow one instance of a server (a registration changed or added it); a change of the server's report
        is one revision. Costs what the one instance does, whatever the server's size."""
        server = self._servers.get(name)
        if server is not None and server.retarget_one(name, target):
            self._record(server.report)
            await self._notify(server.report, name)

    async def drop_instance(self, name: str, instance_id: str) -> None:
        """Forget one registered instance of a server (deregistered or expired)."""
        server = self._servers.get(name)
        if server is not None and server.drop(name, instance_id):
            self._record(server.report)
            await self._notify(server.report, name)

    def set_config_version(self, version: str) -> None:
        """Follow the head's config version; a change bumps the revision so every watcher hears of it at once."""
        if version == self.config_version:
            return
        first = not self.config_version
        self.config_version = version
        if not first:
            self._bump()

    def reports(self) -> list[StatusReport]:
        """The latest report of every server, in config order."""
        return [server.report for server in self._servers.values()]

    def report(self, name: str) -> StatusReport:
        return self._servers[name].report

    def changes_since(self, revision: int, until: int | None = None) -> Changes:
        """Everything a watcher at `revision` has not seen up to `until` (None: the current revision; a push's
        revision, so every watcher at `revision` gets the same message): the changed reports (the latest of each
        server), or a compacted snapshot of now when the history no longer reaches back to `revision`."""
        return changes_in_history(self._history, self.revision, revision, until, self.reports)

    async def wait_for_change(self, after_revision: int, timeout: float) -> bool:
        """Wait until the revision passes `after_revision`; False when `timeout` ran out first."""
        deadline = time.monotonic() + timeout
        while self.revision <= after_revision:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            # Every watcher waits on the one future of the next change: no task or event waiter per watcher.
            if self._next_change is None:
                self._next_change = asyncio.get_running_loop().create_future()
            await asyncio.wait((self._next_change,), timeout=remaining)
        return True

    def fresh_report(self, name: str, max_age_seconds: float) -> StatusReport | None:
        """The cached report when every instance's probe result is no older than `max_age_seconds`, else None."""
        server = self._servers[name]
        if all(server.is_fresh(instance_id, max_age_seconds) for instance_id in server.instances):
            return server.report
        return None

    def waiting_on_probe(self, name: str) -> bool:
        """Whether a probe of an instance of the server is in flight (callers asking now share it)."""
        return any(key[0] == name for key in self._in_flight)

    async def probe_now(self, name: str, timeout: float, max_age_seconds: float = 0.0) -> StatusReport:
        """The server's report with every instance whose result is older than `max_age_seconds` (0: every
        instance) probed now, or joined to its probe in flight; each result is recorded when it comes.

        The caller waits at most `timeout`: an instance whose shared probe outlasts it is TIMEOUT in this caller's
        report (not recorded; the probe itself goes on for the callers that wait longer)."""
        started = time.monotonic()
        server = self._servers[name]
        stale = [i for i in server.instances if not server.is_fresh(i, max_age_seconds)]
        tasks = [self._shared_probe(name, instance_id, timeout) for instance_id in stale]
        done = await asyncio.gather(*(self._within(task, timeout) for task in tasks))
        server = self._servers.get(name, server)  # a reload may have replaced it meanwhile
        late = {instance_id for instance_id, answer in zip(stale, done, strict=True) if answer is None}
        instances = tuple(
            dataclasses.replace(
                instance,
                status="timeout",
                detail=f"no answer within {timeout:.3g}s",
                http_status=0,
                latency_seconds=time.monotonic() - started,
                checked_at=time.time(),
            )
            if instance_id in late
            else instance
            for instance_id, instance in server.instances.items()
        )
        return server_report(name, instances, server.config_target.advertised_url)

    @staticmethod
    async def _within(task: asyncio.Task[InstanceReport], timeout: float) -> InstanceReport | None:
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(timeout, 0.001))
        except TimeoutError:
            return None

    async def probe_all(self) -> None:
        """One background round: every instance whose cached result is older than the freshness window (an
        instance an on-demand probe just answered for is not asked again)."""
        window = min(self.default_max_age_seconds, self.interval_seconds / 2)
        tasks = [
            self._shared_probe(name, instance_id, self.probe_timeout_seconds)
            for name, server in list(self._servers.items())
            for instance_id in list(server.instances)
            if not server.is_fresh(instance_id, window)
        ]
        if tasks:
            await asyncio.gather(*(asyncio.shield(task) for task in tasks))
        self.rounds += 1

    def _shared_probe(self, name: str, instance_id: str, timeout: float) -> asyncio.Task[InstanceReport]:
        """The in-flight probe of the instance at its current URL, started with `timeout` when there is none."""
        url = self._servers[name].instances[instance_id].url
        key = (name, instance_id)
        in_flight = self._in_flight.get(key)
        if in_flight is not None and in_flight[0] == url and not in_flight[1].done():
            self.probes_joined += 1
            return in_flight[1]
        assert self._session is not None, "prober not started"
        self.probes_started += 1
        task = asyncio.create_task(self._probe_and_store(self._session, name, instance_id, url, timeout))
        self._in_flight[key] = (url, task)
        return task

    async def _probe_and_store(
        self, session: aiohttp.ClientSession, name: str, instance_id: str, url: str, timeout: float
    ) -> InstanceReport:
        try:
            async with self._slots_of(name), self._slots:  # its server's share, then one of the head's
                result = await probe(session, name, url, timeout)  # the timeout runs from here: slots held
            return await self._store(name, instance_id, result)
        finally:
            current = self._in_flight.get((name, instance_id))
            if current is not None and current[1] is asyncio.current_task():
                del self._in_flight[(name, instance_id)]

    def _slots_of(self, name: str) -> asyncio.Semaphore:
        """The server's probes in flight, at most PROBES_PER_SERVER: its mute instances hold its own slots, never
        every slot of the head."""
        slots = self._server_slots.get(name)
        if slots is None:
            if len(self._server_slots) > 2 * len(self._servers) + 16:  # servers that left: drop the idle ones
                for gone in [
                    n for n, sem in self._server_slots.items() if n not in self._servers and not sem.locked()
                ]:
                    del self._server_slots[gone]
            slots = self._server_slots[name] = asyncio.Semaphore(PROBES_PER_SERVER)
        return slots

    async def _run(self) -> None:
        await run_every(self.interval_seconds, self.probe_all, "status probe round", logger, now=True)

    async def _store(self, name: str, instance_id: str, result: StatusReport) -> InstanceReport:
        """Record a probe result of an instance, just in; the instance's report as recorded (as probed, unrecorded,
        when the instance left or moved while it was being probed)."""
        server = self._servers.get(name)
        previous = server.instances.get(instance_id) if server is not None else None
        if server is None or previous is None or previous.url != result.url:
            return with_probe(InstanceReport(instance_id=instance_id, url=result.url), result)
        server.probed_at[instance_id] = time.monotonic()
        instance = server.instances[instance_id] = with_probe(previous, result)
        in_a_row = server.in_status.get(instance_id, 0)
        server.in_status[instance_id] = in_a_row + 1 if previous.status == instance.status else 1
        events.probe_stored(name, previous, instance, in_a_row, len(server.instances))
        if watched_instance(previous) == watched_instance(instance):  # no change watches follow: made when read
            server.stale = True
        elif server.compose(name, previous):
            self._record(server.report)
            await self._notify(server.report, name)
        return instance

    def _record(self, report: StatusReport) -> None:
        self._bump()
        self._history.append((self.revision, report))

    def _bump(self) -> None:
        self.revision += 1
        changed, self._next_change = self._next_change, None
        if changed is not None:
            changed.set_result(None)
        self.pushes.changed()

    async def _notify(self, report: StatusReport | None, name: str) -> None:
        if self._on_change is not None:
            await self._on_change(report, name)
