"""The head's background prober: probes every server concurrently, caches the results, and keeps the watch
history.

Borrowed from etcd and xDS: every status change bumps one rising revision, a bounded history of changes lets a
watch resume from the last revision it saw, and a resume older than the history gets a fresh snapshot.

Probes are single-flight (as Go's singleflight and Envoy's health checker merge them): every probe of a server,
background or on demand, goes through one in-flight task per server that concurrent callers share, and a result
younger than the freshness window is served from the cache. So a thousand pollers of one server cost that server
at most one probe per window, not a thousand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from gym_rpc._tasks import cancel_and_wait, run_every
from gym_rpc._version import __version__
from gym_rpc.config import ServerEntry
from gym_rpc.server import _events as events
from gym_rpc.wire import TRACEPARENT_HEADER, RegistrationState, ServerStatus, StatusReport

logger = logging.getLogger(__name__)

PROBE_USER_AGENT = f"gym-rpc-probe/{__version__}"
AIOHTTP_INSTRUMENTATION_MODULE = "opentelemetry.instrumentation.aiohttp_client"

ChangeListener = Callable[[StatusReport | None, str], Awaitable[None]]


def new_probe_session(max_connections: int = 100) -> aiohttp.ClientSession:
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
    """GET the server's base URL. Any HTTP answer, a 500 included, is success (as NeMo Gym does)."""
    started = time.monotonic()
    status: ServerStatus
    http_status = 0
    detail = ""
    try:
        async with session.get(
            url,
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


class StatusProber:
    """Probes servers on an interval; the single writer of the status cache and its revision."""

    def __init__(
        self,
        servers: Mapping[str, ServerEntry],
        *,
        interval_seconds: float = 2.0,
        probe_timeout_seconds: float = 1.0,
        history_size: int = 1024,
        on_change: ChangeListener | None = None,
        default_max_age_seconds: float | None = None,
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
        self._in_flight: dict[str, tuple[str, asyncio.Task[StatusReport]]] = {}  # name -> (url, probe task)
        # Start at the wall clock in milliseconds, so revisions keep rising across head restarts and a watch
        # resuming with a revision issued by an earlier head is never mistaken for one from this head's history.
        self.revision = time.time_ns() // 1_000_000
        self._urls: dict[str, str] = {}
        self._reports: dict[str, StatusReport] = {}
        # time.monotonic() of each server's stored probe result: freshness is judged on it, never on the shown
        # `checked_at` (wall clock), so stepping the wall clock neither freezes nor floods the probes.
        self._probed_at: dict[str, float] = {}
        self._probes_in_status: dict[str, int] = {}  # probes in a row that gave the server's current status
        self._history: deque[tuple[int, StatusReport]] = deque(maxlen=history_size)
        self._next_change: asyncio.Future[None] | None = None  # made by the first waiter, in its running loop
        self._on_change = on_change
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending_servers = servers

    async def start(self) -> None:
        self._session = new_probe_session()
        await self.set_servers(self._pending_servers)
        self._task = asyncio.create_task(self._run(), name="gym_rpc status prober")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for _, task in list(self._in_flight.values()):
            await cancel_and_wait(task)
        self._in_flight.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def set_servers(self, servers: Mapping[str, ServerEntry]) -> None:
        """Follow a (re)loaded config: new servers start unprobed, removed ones leave, moved ones restart."""
        removed = [n for n in self._urls if n not in servers]
        for name in removed:
            del self._urls[name]
            del self._reports[name]
            self._probed_at.pop(name, None)
            self._probes_in_status.pop(name, None)
            await self._notify(None, name)
        if removed:  # a removal is no report: drop the history so every watcher gets a fresh snapshot
            self._history.clear()
            self._bump()
        for name, entry in servers.items():
            if self._urls.get(name) != entry.url:
                self._urls[name] = entry.url
                previous = self._reports.get(name)
                self._reports[name] = StatusReport(
                    server_name=name,
                    status=None,
                    url=entry.url,
                    registration=previous.registration if previous is not None else None,
                    advertised_url=previous.advertised_url if previous is not None else "",
                )
                self._probes_in_status[name] = 0
                self._probed_at.pop(name, None)
                self._record(self._reports[name])
                await self._notify(self._reports[name], name)

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
        return list(self._reports.values())

    def report(self, name: str) -> StatusReport:
        return self._reports[name]

    def changes_since(self, revision: int) -> Changes:
        """Everything a watcher at `revision` has not seen: the changed reports, or a compacted snapshot."""
        if revision >= self.revision:
            return Changes(self.revision, [], compacted=False)
        oldest = self._history[0][0] if self._history else self.revision + 1
        if revision < oldest - 1:
            return Changes(self.revision, self.reports(), compacted=True)
        latest: dict[str, StatusReport] = {}
        for rev, report in self._history:
            if rev > revision:
                latest[report.server_name] = report
        return Changes(self.revision, list(latest.values()), compacted=False)

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
        """The cached result when it is a probe result no older than `max_age_seconds`, else None."""
        cached = self._reports[name]
        probed_at = self._probed_at.get(name)
        if max_age_seconds > 0 and probed_at is not None and time.monotonic() - probed_at <= max_age_seconds:
            return cached
        return None

    def waiting_on_probe(self, name: str) -> bool:
        """Whether a probe of the server is in flight (callers asking now share it)."""
        return name in self._in_flight

    async def probe_now(self, name: str, timeout: float) -> StatusReport:
        """The server's status from a probe started now or already in flight, recorded when it finishes.

        The caller waits at most `timeout`: a shared probe that outlasts it answers this caller with TIMEOUT (not
        recorded; the probe itself goes on for the callers that wait longer)."""
        started = time.monotonic()
        task = self._shared_probe(name, timeout)
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(timeout, 0.001))
        except TimeoutError:
            return StatusReport(
                server_name=name,
                status="timeout",
                url=self._urls.get(name, ""),
                latency_seconds=time.monotonic() - started,
                checked_at=time.time(),
                detail=f"no answer within {timeout:.3g}s",
            )

    async def probe_all(self) -> None:
        """One background round: every server whose cached result is older than the freshness window (a server
        an on-demand probe just answered for is not asked again)."""
        window = min(self.default_max_age_seconds, self.interval_seconds / 2)
        tasks = [
            self._shared_probe(name, self.probe_timeout_seconds)
            for name in list(self._urls)
            if self.fresh_report(name, window) is None
        ]
        if tasks:
            await asyncio.gather(*(asyncio.shield(task) for task in tasks))

    def _shared_probe(self, name: str, timeout: float) -> asyncio.Task[StatusReport]:
        """The in-flight probe of `name` at its current URL, started with `timeout` when there is none."""
        url = self._urls[name]
        in_flight = self._in_flight.get(name)
        if in_flight is not None and in_flight[0] == url and not in_flight[1].done():
            self.probes_joined += 1
            return in_flight[1]
        assert self._session is not None, "prober not started"
        self.probes_started += 1
        task = asyncio.create_task(self._probe_and_store(self._session, name, url, timeout))
        self._in_flight[name] = (url, task)
        return task

    async def _probe_and_store(
        self, session: aiohttp.ClientSession, name: str, url: str, timeout: float
    ) -> StatusReport:
        try:
            return await self._store(await probe(session, name, url, timeout))
        finally:
            current = self._in_flight.get(name)
            if current is not None and current[1] is asyncio.current_task():
                del self._in_flight[name]

    async def _run(self) -> None:
        await run_every(self.interval_seconds, self.probe_all, "status probe round", logger, now=True)

    async def _store(self, report: StatusReport) -> StatusReport:
        """Record a probe result, just in (with the registration the server has now); the report as recorded."""
        previous = self._reports.get(report.server_name)
        if previous is None or self._urls.get(report.server_name) != report.url:
            return report  # the server left or moved while it was being probed
        self._probed_at[report.server_name] = time.monotonic()
        report = dataclasses.replace(
            report, registration=previous.registration, advertised_url=previous.advertised_url
        )
        self._reports[report.server_name] = report
        name = report.server_name
        in_a_row = self._probes_in_status.get(name, 0)
        self._probes_in_status[name] = in_a_row + 1 if previous.status == report.status else 1
        events.probe_stored(previous, report, in_a_row)
        if previous.status != report.status:
            self._record(report)
            await self._notify(report, report.server_name)
        return report

    async def set_registration(self, name: str, state: RegistrationState | None, advertised_url: str) -> None:
        """Follow a server's registration; a change of it is recorded (and watched) like a status change."""
        report = self._reports.get(name)
        if report is None or (report.registration, report.advertised_url) == (state, advertised_url):
            return
        report = dataclasses.replace(report, registration=state, advertised_url=advertised_url)
        self._reports[name] = report
        self._record(report)
        await self._notify(report, name)

    def _record(self, report: StatusReport) -> None:
        self._bump()
        self._history.append((self.revision, report))

    def _bump(self) -> None:
        self.revision += 1
        changed, self._next_change = self._next_change, None
        if changed is not None:
            changed.set_result(None)

    async def _notify(self, report: StatusReport | None, name: str) -> None:
        if self._on_change is not None:
            await self._on_change(report, name)
