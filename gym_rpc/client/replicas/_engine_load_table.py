"""The engines' load as a client knows it: the head reads each engine instance's `/metrics` (requests waiting and
running, KV-cache use) and pushes the table down the status watch a few times a second; the follower hands each
table to every client's routes (`Routing.engine_loads`), where a picker reads it without any I/O.

A figure older than ENGINE_LOAD_MAX_AGE_SECONDS (the head stopped reading it, or stopped pushing) is unknown, never
zero: an engine whose `/metrics` went quiet is never taken for an idle one. Ages are the head's (how old a figure
was when it was sent) plus this process's own monotonic time since, so no two clocks are compared.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from gym_rpc.wire import ENGINE_LOAD_MAX_AGE_SECONDS, EngineLoad


class EngineLoadTable:
    """server name -> instance id -> its latest load. Written by the follower's thread, read by any worker's
    loop: each push replaces the whole table at once (one reference swap), so a reader never sees half of one."""

    __slots__ = ("_clock", "_lock", "_max_age", "_table")

    def __init__(
        self, max_age_seconds: float = ENGINE_LOAD_MAX_AGE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_age = max_age_seconds
        self._clock = clock
        self._lock = threading.Lock()
        # server -> instance -> (load, monotonic time its figures were read, None: never read)
        self._table: dict[str, dict[str, tuple[EngineLoad, float | None]]] = {}

    def apply(self, loads: Iterable[EngineLoad]) -> None:
        """Take a table the head pushed (every engine instance it reads): it replaces the one held."""
        now = self._clock()
        table: dict[str, dict[str, tuple[EngineLoad, float | None]]] = {}
        for load in loads:
            read_at = None if load.age_seconds is None else now - load.age_seconds
            table.setdefault(load.server_name, {})[load.instance_id] = (load, read_at)
        with self._lock:
            self._table = table

    def of(self, server_name: str, instance_id: str) -> EngineLoad | None:
        """The instance's load with its age as of now, or None: unknown (never pushed, never read, or older than
        the bound). A figure the engine does not report is None inside it."""
        entry = self._table.get(server_name, {}).get(instance_id)
        if entry is None:
            return None
        load, read_at = entry
        if read_at is None:
            return None
        age = self._clock() - read_at
        if age > self._max_age:
            return None
        return EngineLoad(load.server_name, load.instance_id, load.waiting, load.running, load.kv_cache_usage, age)

    def server(self, server_name: str) -> dict[str, EngineLoad]:
        """instance id -> load of every instance of `server_name` whose load is known now."""
        known = {}
        for instance_id in self._table.get(server_name, {}):
            load = self.of(server_name, instance_id)
            if load is not None:
                known[instance_id] = load
        return known
