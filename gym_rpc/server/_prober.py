"""The head's background prober: probes every server concurrently, caches the results, and keeps the watch
history.

Borrowed from etcd and xDS: every status change bumps one rising revision, a bounded history of changes lets a
watch resume from the last revision it saw, and a resume older than the history gets a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from gym_rpc.config import ServerEntry
from gym_rpc.wire import ServerStatus, StatusReport

logger = logging.getLogger(__name__)

ChangeListener = Callable[[StatusReport | None, str], Awaitable[None]]


def new_probe_session(max_connections: int = 100) -> aiohttp.ClientSession:
    """A session for probes: a fresh connection per probe (a pooled one would hide a restarted or dead
    server behind a stale socket), no proxies, no cookies."""
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=True)
    return aiohttp.ClientSession(connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar())


async def probe(session: aiohttp.ClientSession, server_name: str, url: str, timeout: float) -> StatusReport:
    """GET the server's base URL. Any HTTP answer, a 500 included, is success (as NeMo Gym does)."""
    started = time.monotonic()
    status: ServerStatus
    http_status = 0
    detail = ""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=max(timeout, 0.001))) as response:
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
    ) -> None:
        self.interval_seconds = interval_seconds
        self.probe_timeout_seconds = probe_timeout_seconds
        # Start at the wall clock in milliseconds, so revisions keep rising across head restarts and a watch
        # resuming with a revision issued by an earlier head is never mistaken for one from this head's history.
        self.revision = time.time_ns() // 1_000_000
        self._urls: dict[str, str] = {}
        self._reports: dict[str, StatusReport] = {}
        self._history: deque[tuple[int, StatusReport]] = deque(maxlen=history_size)
        self._changed = asyncio.Event()
        self._on_change = on_change
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending_servers = servers

    async def start(self) -> None:
        self._session = new_probe_session()
        await self.set_servers(self._pending_servers)
        self._task = asyncio.create_task(self._run(), name="gym_rpc status prober")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def set_servers(self, servers: Mapping[str, ServerEntry]) -> None:
        """Follow a (re)loaded config: new servers start unprobed, removed ones leave, moved ones restart."""
        removed = [n for n in self._urls if n not in servers]
        for name in removed:
            del self._urls[name]
            del self._reports[name]
            await self._notify(None, name)
        if removed:  # a removal is no report: drop the history so every watcher gets a fresh snapshot
            self._history.clear()
            self._bump()
        for name, entry in servers.items():
            if self._urls.get(name) != entry.url:
                self._urls[name] = entry.url
                self._reports[name] = StatusReport(server_name=name, status=None, url=entry.url)
                self._record(self._reports[name])
                await self._notify(self._reports[name], name)

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
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return self.revision > after_revision
        return True

    async def probe_now(self, name: str, timeout: float) -> StatusReport:
        """Probe one server at once (for GetServerStatus) and record the result."""
        url = self._urls[name]
        assert self._session is not None, "prober not started"
        report = await probe(self._session, name, url, timeout)
        await self._store(report)
        return report

    async def probe_all(self) -> None:
        assert self._session is not None, "prober not started"
        session = self._session
        names = list(self._urls.items())
        results = await asyncio.gather(
            *(probe(session, name, url, self.probe_timeout_seconds) for name, url in names)
        )
        for report in results:
            await self._store(report)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.probe_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # the prober must outlive any single bad round
                logger.exception("status probe round failed")
            await asyncio.sleep(max(0.0, self.interval_seconds - (time.monotonic() - started)))

    async def _store(self, report: StatusReport) -> None:
        previous = self._reports.get(report.server_name)
        if previous is None or self._urls.get(report.server_name) != report.url:
            return  # the server left or moved while it was being probed
        self._reports[report.server_name] = report
        if previous.status != report.status:
            self._record(report)
            await self._notify(report, report.server_name)

    def _record(self, report: StatusReport) -> None:
        self._bump()
        self._history.append((self.revision, report))

    def _bump(self) -> None:
        self.revision += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def _notify(self, report: StatusReport | None, name: str) -> None:
        if self._on_change is not None:
            await self._on_change(report, name)
