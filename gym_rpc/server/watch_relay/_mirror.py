"""A node's copy of the head's statuses, kept by the watch relay from the head's watch and read by the relay's own
watches as the head's are read from its prober (gym_rpc.server.fleet.WatchedStatuses).

The mirror counts revisions of its own (from the wall clock in ms, as the prober does): the head's revisions are
each head's own, and a relay that moves to another head of the list, or is restarted, must still give its local
watchers a revision that only rises. Each server whose report the head changes is one revision here, kept in a
bounded history so a local watcher resumes from where it was; a server the head no longer lists clears the history
(as the prober does on a removal), so every local watcher gets a fresh snapshot. Pushes to the local watchers are
debounced as the head's are (gym_rpc.server.fleet.Pushes): a slow local watcher gets the latest state merged.
"""

from __future__ import annotations

import time
from collections import deque

from gym_rpc.server.fleet import (
    DEFAULT_MAX_DELAY_SECONDS,
    DEFAULT_QUIET_SECONDS,
    Changes,
    EngineLoads,
    Pushes,
    changes_in_history,
)
from gym_rpc.wire import StatusReport, WatchEvent

DEFAULT_HISTORY_SIZE = 1024


class StatusMirror:
    """The head's latest report of each server, as its watch told the relay; `synced` once a snapshot came."""

    def __init__(
        self,
        *,
        history_size: int = DEFAULT_HISTORY_SIZE,
        push_quiet_seconds: float = DEFAULT_QUIET_SECONDS,
        push_max_delay_seconds: float = DEFAULT_MAX_DELAY_SECONDS,
    ) -> None:
        self.revision = time.time_ns() // 1_000_000
        self.config_version = ""
        self.synced = False  # a snapshot came: the mirror has something to serve
        self.head_revision = 0  # the revision of the head's last event (what the relay resumes from)
        self._reports: dict[str, StatusReport] = {}
        self._history: deque[tuple[int, StatusReport]] = deque(maxlen=history_size)
        self.pushes = Pushes(
            lambda: self.revision, quiet_seconds=push_quiet_seconds, max_delay_seconds=push_max_delay_seconds
        )
        # The engines' load the head sends (ENGINE_LOAD events): nothing is read here, only passed on.
        self.engine_loads = EngineLoads(list)

    def apply(self, event: WatchEvent) -> None:
        """Fold one event of the head's watch in; local watchers are woken through `pushes`."""
        if event.kind == "engine_load":
            self.engine_loads.take(event.engine_loads)
            return
        if event.kind == "snapshot":
            listed = {report.server_name: report for report in event.reports}
            removed = [name for name in self._reports if name not in listed]
            if removed:
                for name in removed:
                    del self._reports[name]
                self._history.clear()  # a removal is no report: every local watcher gets a fresh snapshot
                self._bump()
            self._record_changed(event.reports)
            self.synced = True
        elif event.kind == "change":
            self._record_changed(event.reports)
        self.head_revision = event.revision
        if event.config_version and event.config_version != self.config_version:
            first = not self.config_version
            self.config_version = event.config_version
            if not first:
                self._bump()  # every local watcher hears of a new config at once, as the head's do

    def reports(self) -> list[StatusReport]:
        return list(self._reports.values())

    def changes_since(self, revision: int, until: int | None = None) -> Changes:
        """StatusProber.changes_since's answer, from the mirror's history."""
        return changes_in_history(self._history, self.revision, revision, until, self.reports)

    def close(self) -> None:
        self.pushes.close()

    def _record_changed(self, reports: list[StatusReport]) -> None:
        for report in reports:
            if self._reports.get(report.server_name) == report:
                continue  # a snapshot after a reconnect repeats what the mirror has: no revision
            self._reports[report.server_name] = report
            self._bump()
            self._history.append((self.revision, report))

    def _bump(self) -> None:
        self.revision += 1
        self.pushes.changed()
