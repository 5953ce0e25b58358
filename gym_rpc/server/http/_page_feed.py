"""What the status page (gym_rpc.server.http._status_page) is sent: the fleet as JSON, its changes as server-sent
events, and a timeline of what happened, all made from the head's own change feed (the prober's revisions, which
status watches carry too).

One follower per head turns every revision into one event frame, encoded once and shared by every open page (as
WatchFeed shares watch messages): a page at revision R is sent the frames after R, or a snapshot when the frames
kept no longer reach back (bounded in number and in bytes). The follower runs from the head's start, so the
timeline holds what happened before a page was opened: registrations, instances leaving, status changes, drains,
relabels and reloads, read off the difference between a server's reports before and after each revision.

What moves without a revision (each instance's last check and the calls in flight its process reported) goes out
in a heartbeat, built once per interval for every page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gym_rpc._tasks import cancel_and_wait
from gym_rpc.config import GlobalConfig
from gym_rpc.server.fleet import StatusProber
from gym_rpc.wire import InstanceReport, StatusReport

logger = logging.getLogger("gym_rpc.server._page_feed")  # its name from before the move

HEARTBEAT_SECONDS = 2.0  # a page hears from the head at least this often (last checks, calls in flight)
SNAPSHOT_REUSE_SECONDS = 1.0  # a snapshot at one revision is rebuilt at most this often (its last checks move)
TIMELINE_SIZE = 200  # events a page's timeline shows
MAX_FRAMES = 256  # change frames kept for pages that fall behind (then they get a snapshot)
MAX_FRAME_BYTES = 4 * 1024 * 1024  # ... and at most this many bytes of them
FOLLOW_WAKE_SECONDS = 60.0  # the follower looks again at least this often (a replaced prober, say)


class PageSource(Protocol):
    """What the page reads from the head: its config, prober and registry (HeadServer has them)."""

    config: GlobalConfig
    prober: StatusProber

    @property
    def registry(self) -> _InFlight: ...


class _InFlight(Protocol):
    def in_flight(self, server_name: str) -> dict[str, int]: ...


def sse_frame(event: str, data: Mapping[str, Any], revision: int | None = None) -> bytes:
    """One server-sent event: its type, its id (the revision, so a reconnect can say where it was) and its JSON."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    lines = [f"event: {event}"]
    if revision is not None:
        lines.append(f"id: {revision}")
    return ("\n".join([*lines, f"data: {text}"]) + "\n\n").encode()


def _seconds(value: float) -> float | None:
    return round(value, 3) if value > 0 else None


class EngineLoadFigures(Protocol):
    """One engine instance's load as the head read it from the engine's /metrics: requests waiting and running,
    KV-cache use (0 to 1); None where unknown (gym_rpc.wire's EngineLoad has these)."""

    @property
    def server_name(self) -> str: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def waiting(self) -> float | None: ...
    @property
    def running(self) -> float | None: ...
    @property
    def kv_cache_usage(self) -> float | None: ...


EngineLoadSource = Callable[[], Iterable[EngineLoadFigures]]


def engine_json(load: EngineLoadFigures | None) -> dict[str, Any] | None:
    """What the page shows of an engine's load; None when the head reads none for the instance."""
    if load is None:
        return None
    figures = {"queue": load.waiting, "running": load.running, "kv": load.kv_cache_usage}
    return {key: round(value, 3) for key, value in figures.items() if value is not None} or None


def engine_table(source: EngineLoadSource | None) -> dict[tuple[str, str], dict[str, Any]]:
    """(server name, instance id) -> what the page shows of its engine's load, for every engine the head reads."""
    if source is None:
        return {}
    table = {}
    for load in source():
        shown = engine_json(load)
        if shown is not None:
            table[(load.server_name, load.instance_id)] = shown
    return table


def instance_json(
    instance: InstanceReport, in_flight: int | None, engine: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One instance as the page shows it. Text that came from a registration (labels) is sent as it is: the page
    puts it in the DOM as text, never as markup."""
    return {
        "id": instance.instance_id,
        "url": instance.url,
        "status": instance.status,
        "detail": instance.detail,
        "http": instance.http_status or None,
        "latency_ms": round(instance.latency_seconds * 1000, 2) if instance.checked_at else None,
        "checked": _seconds(instance.checked_at),
        "registration": instance.registration,
        "draining": instance.draining,
        "labels": dict(instance.labels),
        "origin": instance.origin,
        "pid": instance.pid or None,
        "started": _seconds(instance.start_time),
        "in_flight": in_flight,
        "engine": engine,
    }


def server_json(
    report: StatusReport,
    server_type: str,
    in_flight: Mapping[str, int],
    engines: Mapping[tuple[str, str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One server: its name, type, status and how many of its instances answer, then every instance."""
    name, engines = report.server_name, engines or {}
    instances = report.instances or (InstanceReport(instance_id=report.url, url=report.url, status=report.status),)
    return {
        "name": report.server_name,
        "type": server_type,
        "url": report.url,
        "status": report.status,
        "up": sum(1 for i in instances if i.status == "success" and not i.draining),
        "total": len(instances),
        "instances": [
            instance_json(i, in_flight.get(i.instance_id), engines.get((name, i.instance_id))) for i in instances
        ],
    }


@dataclass(frozen=True)
class TimelineEvent:
    at: float  # epoch seconds
    kind: str  # registered, left, restarted, status, draining, labels, reload, added, removed
    server: str
    instance: str
    text: str
    tone: str = "info"  # good, bad, info: how the page colours it

    def json(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "kind": self.kind,
            "server": self.server,
            "instance": self.instance,
            "text": self.text,
            "tone": self.tone,
        }


def _labels_text(labels: Mapping[str, str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(labels.items())) or "no labels"


def report_events(before: StatusReport | None, after: StatusReport | None, at: float) -> list[TimelineEvent]:
    """What happened to one server between two of its reports."""
    if before is None:
        if after is None:
            return []
        name = after.server_name
        return [TimelineEvent(at, "added", name, "", f"{name} added to the config")]
    name = before.server_name
    if after is None:
        return [TimelineEvent(at, "removed", name, "", f"{name} removed from the config", "bad")]
    old = {i.instance_id: i for i in before.instances}
    new = {i.instance_id: i for i in after.instances}
    events: list[TimelineEvent] = []
    for instance_id, instance in new.items():
        previous = old.get(instance_id)
        events += _instance_events(name, previous, instance, at)
    for instance_id, instance in old.items():
        if instance_id not in new:
            pid = f" (pid {instance.pid})" if instance.pid else ""
            events.append(
                TimelineEvent(at, "left", name, instance_id, f"left{pid}: deregistered or lease expired", "bad")
            )
    return events


def _instance_events(
    name: str, previous: InstanceReport | None, instance: InstanceReport, at: float
) -> list[TimelineEvent]:
    iid = instance.instance_id
    registered = instance.registration == "registered"
    if previous is None:
        pid = f" pid {instance.pid}" if instance.pid else ""
        what = f"registered{pid} at {instance.url}" if registered else f"instance {iid} listed ({instance.origin})"
        return [TimelineEvent(at, "registered", name, iid, what, "good")]
    events = []
    if registered and previous.registration != "registered":
        events.append(TimelineEvent(at, "registered", name, iid, f"registered pid {instance.pid}", "good"))
    elif previous.registration == "registered" and not registered:
        why = instance.registration or "gone"
        events.append(TimelineEvent(at, "left", name, iid, f"registration {why} (pid {previous.pid})", "bad"))
    elif registered and previous.pid != instance.pid:
        text = f"pid {previous.pid} replaced by pid {instance.pid} (a restart)"
        events.append(TimelineEvent(at, "restarted", name, iid, text))
    if previous.status != instance.status:
        before, after = previous.status or "pending", instance.status or "pending"
        detail = f" ({instance.detail})" if instance.detail and after != "success" else ""
        tone = "good" if after == "success" else "bad"
        events.append(TimelineEvent(at, "status", name, iid, f"{before} -> {after}{detail}", tone))
    if previous.draining != instance.draining:
        text = "draining" if instance.draining else "no longer draining"
        events.append(TimelineEvent(at, "draining", name, iid, text, "bad" if instance.draining else "good"))
    if dict(previous.labels) != dict(instance.labels):
        events.append(TimelineEvent(at, "labels", name, iid, f"labels: {_labels_text(instance.labels)}"))
    return events


@dataclass
class _Frames:
    """Change frames by the revision each reaches, oldest first, bounded in number and bytes."""

    frames: deque[tuple[int, bytes]] = field(default_factory=deque)
    size: int = 0
    oldest_base: int = 0  # the revision the oldest kept frame starts from

    def add(self, base: int, revision: int, frame: bytes) -> None:
        if not self.frames:
            self.oldest_base = base
        self.frames.append((revision, frame))
        self.size += len(frame)
        while self.frames and (len(self.frames) > MAX_FRAMES or self.size > MAX_FRAME_BYTES):
            dropped_revision, dropped = self.frames.popleft()
            self.size -= len(dropped)
            self.oldest_base = dropped_revision

    def after(self, seen: int) -> list[bytes] | None:
        """The frames a page at `seen` has not had; None when they no longer reach back that far."""
        if seen < self.oldest_base:
            return None
        return [frame for revision, frame in self.frames if revision > seen]


class PageFeed:
    """The head's fleet as the page sees it, followed from the prober; start() at the head's start, stop() at its
    end. Pages wait with `wait_for_change` and take `frames_after`, `snapshot` and `heartbeat`: shared bytes."""

    def __init__(
        self,
        head: PageSource,
        *,
        head_info: Callable[[], dict[str, Any]] = dict,
        engine_loads: EngineLoadSource | None = None,
    ) -> None:
        self._head = head
        self._head_info = head_info
        self._engine_loads = engine_loads  # the engines' load the head reads, when it reads any
        self.revision = 0  # the prober revision the frames reach
        self.config_version = ""
        self._reports: dict[str, StatusReport] = {}
        self._servers: dict[str, dict[str, Any]] = {}  # name -> server_json, at `revision`
        self.timeline: deque[TimelineEvent] = deque(maxlen=TIMELINE_SIZE)
        self._frames = _Frames()
        self._snapshot: tuple[tuple[int, int], bytes] | None = None
        self._heartbeat: tuple[tuple[int, int], bytes] | None = None
        self._next: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.closed = False
        self.frames_built = 0  # change frames encoded (tests and the bench read it)

    async def start(self) -> None:
        self.closed = False
        self._take_everything(time.time(), record=False)
        self._task = asyncio.create_task(self._follow(), name="gym_rpc status page feed")

    async def stop(self) -> None:
        """Stop following; every page waiting is woken and ends its stream."""
        self.closed = True
        self._wake()
        await cancel_and_wait(self._task)
        self._task = None

    async def _follow(self) -> None:
        while True:
            prober = self._head.prober
            await prober.wait_for_change(self.revision, FOLLOW_WAKE_SECONDS)
            try:
                self.follow_now()
            except Exception:  # one bad round must not end the page's feed
                logger.exception("status page feed failed to follow a change")
                await asyncio.sleep(HEARTBEAT_SECONDS)

    def follow_now(self) -> None:
        """Take every change since the last one taken: one frame, and the timeline's events."""
        prober = self._head.prober
        if prober.revision <= self.revision:
            return
        changes = prober.changes_since(self.revision)
        now = time.time()
        if changes.compacted:
            self._take_everything(now, record=True)
            return
        base = self.revision
        events: list[TimelineEvent] = []
        version = prober.config_version
        if version != self.config_version:
            events.append(
                TimelineEvent(
                    now, "reload", "", "", f"config reloaded: version {self.config_version} -> {version}"
                )
            )
            self.config_version = version
        changed = []
        for report in changes.reports:
            events += report_events(self._reports.get(report.server_name), report, now)
            self._reports[report.server_name] = report
            self._servers[report.server_name] = self._server_json(report)
            changed.append(self._servers[report.server_name])
        self.revision = changes.revision
        self.timeline.extend(events)
        data = {
            "revision": self.revision,
            "config_version": version,
            "servers": changed,
            "removed": [],
            "events": [event.json() for event in events],
        }
        self._frames.add(base, self.revision, sse_frame("change", data, self.revision))
        self.frames_built += 1
        self._wake()

    def _take_everything(self, now: float, *, record: bool) -> None:
        """Follow from every current report (at start, and when the prober's history no longer reaches back)."""
        prober = self._head.prober
        reports = {report.server_name: report for report in prober.reports()}
        base = self.revision
        events: list[TimelineEvent] = []
        if record and prober.config_version != self.config_version:
            text = f"config reloaded: version {self.config_version} -> {prober.config_version}"
            events.append(TimelineEvent(now, "reload", "", "", text))
        if record:
            for name in self._reports.keys() | reports.keys():
                old, new = self._reports.get(name), reports.get(name)
                if old is not new:
                    events += report_events(old, new, now)
        removed = [name for name in self._reports if name not in reports]
        self._reports = reports
        self._servers = {name: self._server_json(report) for name, report in reports.items()}
        self.revision, self.config_version = prober.revision, prober.config_version
        self.timeline.extend(events)
        if record:
            data = {
                "revision": self.revision,
                "config_version": self.config_version,
                "servers": list(self._servers.values()),
                "removed": removed,
                "events": [event.json() for event in events],
            }
            self._frames.add(base, self.revision, sse_frame("change", data, self.revision))
            self.frames_built += 1
            self._wake()

    def _server_json(
        self, report: StatusReport, engines: Mapping[tuple[str, str], dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        entry = self._head.config.servers.get(report.server_name)
        in_flight = self._head.registry.in_flight(report.server_name)
        return server_json(report, entry.server_type if entry is not None else "", in_flight, engines)

    def _wake(self) -> None:
        waiting, self._next = self._next, None
        if waiting is not None and not waiting.done():
            waiting.set_result(None)

    async def wait_for_change(self, seen: int, timeout: float) -> bool:
        """Wait until the frames pass `seen` (or the feed stops); False when `timeout` ran out first. Every page
        waits on one future: no task per page."""
        if self.revision > seen or self.closed:
            return True
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._next), timeout)
            return True
        return self.revision > seen or self.closed

    def frames_after(self, seen: int) -> list[bytes] | None:
        """What a page at `seen` must be sent; None when it needs a snapshot instead."""
        if seen > self.revision:  # a revision from another head (this one restarted): start afresh
            return None
        return self._frames.after(seen)

    def snapshot(self) -> tuple[int, bytes]:
        """Everything at the current revision, and the revision: a page's first frame, and its catch-up."""
        key = (self.revision, int(time.monotonic() / SNAPSHOT_REUSE_SECONDS))
        if self._snapshot is None or self._snapshot[0] != key:
            # The reports at the feed's revision (what its change frames and heartbeats follow), with each
            # instance's last check as the prober has it now: checks move on between revisions.
            engines = engine_table(self._engine_loads)
            servers = [self._server_json(report, engines) for report in self._reports.values()]
            prober = self._head.prober
            for server in servers:
                try:
                    probed = {i.instance_id: i.checked_at for i in prober.report(server["name"]).instances}
                except KeyError:
                    continue
                for instance in server["instances"]:
                    instance["checked"] = _seconds(probed.get(instance["id"], 0.0)) or instance["checked"]
            data = {
                "revision": self.revision,
                "config_version": self.config_version,
                "now": round(time.time(), 3),
                "heartbeat_seconds": HEARTBEAT_SECONDS,
                "head": self._head_info(),
                "servers": servers,
                "events": [event.json() for event in self.timeline],
            }
            self._snapshot = (key, sse_frame("snapshot", data, self.revision))
        return self.revision, self._snapshot[1]

    def heartbeat(self) -> bytes:
        """What moved without a revision: each instance's last check (seconds before `now`) and the calls in flight
        its process reported, per server in instance order; applied by a page at the same revision only."""
        key = (self.revision, int(time.monotonic() / HEARTBEAT_SECONDS))
        if self._heartbeat is None or self._heartbeat[0] != key:
            now = time.time()
            prober = self._head.prober
            checks: dict[str, list[float | None]] = {}
            in_flight: dict[str, list[int | None]] = {}
            engines = engine_table(self._engine_loads)
            engine: dict[str, list[dict[str, Any] | None]] = {}
            for name, report in self._reports.items():
                try:
                    current = prober.report(name)
                except KeyError:
                    continue
                probed = {i.instance_id: i.checked_at for i in current.instances}
                ids = [i.instance_id for i in report.instances]  # in the order the page has them
                checks[name] = [round(now - t, 1) if (t := probed.get(iid, 0.0)) else None for iid in ids]
                reported = self._head.registry.in_flight(name)
                if reported:
                    in_flight[name] = [reported.get(iid) for iid in ids]
                loads = [engines.get((name, iid)) for iid in ids] if engines else []
                if any(loads):
                    engine[name] = loads
            data = {
                "revision": self.revision,
                "now": round(now, 3),
                "ago": checks,
                "in_flight": in_flight,
                "engine": engine,
            }
            self._heartbeat = (key, sse_frame("heartbeat", data))
        return self._heartbeat[1]
