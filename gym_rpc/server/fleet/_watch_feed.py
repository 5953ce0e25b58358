"""Watch fan-out: the messages every status watch sends, built and serialised once however many watchers there are.

Watchers woken by one change all stand at the same revision and need the same message, so the first one to ask
builds it and the rest reuse it; gRPC then serialises each message object once (`serialize` is the watch's
response serializer) instead of once per watcher. A watcher that falls behind costs nothing while it lags: its
stream holds only the revision it has delivered, and when it catches up it gets one merged CHANGE of what it
missed, or a snapshot flagged `compacted` once the head's history no longer reaches back that far.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

from gym_rpc.server.fleet._engine_load import EngineLoads
from gym_rpc.server.fleet._prober import Changes
from gym_rpc.server.fleet._pushes import Pushes
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import StatusReport, convert

Message = pb.WatchServerStatusesResponse

# Distinct messages kept: the current change, a few lagging watchers' merges, snapshots, heartbeats.
DEFAULT_CACHE_SIZE = 64
# A snapshot is rebuilt at least this often even without a change: it carries latencies and probe times, which
# move without bumping the revision.
SNAPSHOT_REUSE_SECONDS = 1.0


class WatchedStatuses(Protocol):
    """What a watch reads of the statuses it follows: the head's StatusProber, or a node's watch relay's mirror of
    a head (gym_rpc.server.watch_relay)."""

    revision: int
    config_version: str
    pushes: Pushes

    def reports(self) -> list[StatusReport]: ...

    def changes_since(self, revision: int, until: int | None = None) -> Changes: ...


class ReportMessages:
    """Each server's latest report as a message, converted once per probe result rather than once per call: a
    thousand-server ListServerStatuses or snapshot then only copies messages (C code) instead of building them."""

    def __init__(self) -> None:
        self._messages: dict[str, tuple[StatusReport, pb.ServerStatusReport]] = {}

    def of(self, reports: list[StatusReport]) -> list[pb.ServerStatusReport]:
        """Messages of every server's latest report (the whole list: servers missing from it are forgotten)."""
        messages = [self._message(report) for report in reports]
        if len(self._messages) > 2 * len(reports) + 64:  # servers removed by reloads: forget them
            current = {report.server_name for report in reports}
            self._messages = {k: v for k, v in self._messages.items() if k in current}
        return messages

    def of_changed(self, reports: list[StatusReport]) -> list[pb.ServerStatusReport]:
        """Messages of some servers' reports (a change's): each report converted once, whatever number of
        merged changes carry it."""
        return [self._message(report) for report in reports]

    def _message(self, report: StatusReport) -> pb.ServerStatusReport:
        cached = self._messages.get(report.server_name)
        if cached is not None and cached[0] is report:  # reports are immutable: the same object, the same message
            return cached[1]
        message = convert.report_to_pb(report)
        self._messages[report.server_name] = (report, message)
        return message


class WatchFeed:
    """What a watcher at some revision must be sent next, shared by every watcher at that revision: everything a
    watch reads, the statuses it follows (`prober()`) and the engines' load (`engine_loads()`)."""

    def __init__(
        self,
        prober: Callable[[], WatchedStatuses],
        engine_loads: Callable[[], EngineLoads],
        reports: ReportMessages | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        # Both read on every call: a reload replaces the head's prober.
        self.prober = prober
        self.engine_loads = engine_loads
        self._reports = reports if reports is not None else ReportMessages()
        self._cache_size = cache_size
        self._messages: OrderedDict[Hashable, Message] = OrderedDict()
        # id(message) -> (message, its bytes once serialised), for every cached message
        self._encoded: dict[int, tuple[Message, bytes | None]] = {}
        self.built = 0  # messages built (tests and the scale bench read these)
        self.encoded = 0  # messages serialised

    def snapshot(self, *, compacted: bool) -> tuple[int, Message]:
        """Every server's status at the current revision, and that revision."""
        prober = self.prober()
        revision, version = prober.revision, prober.config_version
        key = ("snapshot", revision, version, compacted, int(time.monotonic() / SNAPSHOT_REUSE_SECONDS))
        return revision, self._get(key, lambda: _snapshot(prober, self._reports, revision, compacted))

    def after(self, seen: int) -> tuple[int, Message | None]:
        """What a watcher that has delivered `seen` must be sent as of the last push (None: nothing), and the
        revision it reaches. Every watcher at `seen` gets the one message of (`seen`, the pushed revision): a
        watcher that fell behind gets the changes it missed merged, the latest report of each server."""
        prober = self.prober()
        pushed, version = prober.pushes.revision, prober.config_version
        if seen >= pushed:
            return seen, None
        message = self._get(
            ("after", seen, pushed, version), lambda: _changes(prober, self._reports, seen, pushed)
        )
        return message.revision, message

    def heartbeat(self, seen: int) -> Message:
        version = self.prober().config_version
        return self._get(
            ("heartbeat", seen, version),
            lambda: Message(type=pb.WATCH_EVENT_TYPE_HEARTBEAT, revision=seen, config_version=version),
        )

    def serialize(self, message: Message) -> bytes:
        """The watch's gRPC response serializer: a shared message is serialised once."""
        entry = self._encoded.get(id(message))
        if entry is not None and entry[0] is message and entry[1] is not None:
            return entry[1]
        data = message.SerializeToString()
        self.encoded += 1
        if entry is not None and entry[0] is message:
            self._encoded[id(message)] = (message, data)
        return data

    def _get(self, key: Hashable, build: Callable[[], Message]) -> Message:
        message = self._messages.get(key)
        if message is not None:
            self._messages.move_to_end(key)
            return message
        message = self._messages[key] = build()
        self._encoded[id(message)] = (message, None)
        self.built += 1
        while len(self._messages) > self._cache_size:
            _, evicted = self._messages.popitem(last=False)
            self._encoded.pop(id(evicted), None)
        return message


def _snapshot(prober: WatchedStatuses, reports: ReportMessages, revision: int, compacted: bool) -> Message:
    return Message(
        type=pb.WATCH_EVENT_TYPE_SNAPSHOT,
        revision=revision,
        reports=reports.of(prober.reports()),
        compacted=compacted,
        config_version=prober.config_version,
    )


def _changes(prober: WatchedStatuses, reports: ReportMessages, seen: int, until: int) -> Message:
    """The reports changed after `seen` up to `until` (latest per server), or a compacted snapshot when history is
    gone. A CHANGE without reports says the config version moved."""
    changes = prober.changes_since(seen, until)
    if changes.compacted:
        return _snapshot(prober, reports, changes.revision, compacted=True)
    return Message(
        type=pb.WATCH_EVENT_TYPE_CHANGE,
        revision=changes.revision,
        reports=reports.of_changed(changes.reports),
        config_version=prober.config_version,
    )
