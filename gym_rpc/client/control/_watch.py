"""A status watch that keeps itself alive: it remembers the last revision, reconnects when the head goes away or
is busy, and resumes from that revision, so callers (the CLI's `status --watch`, `gym-rpc wait`, an orchestrator)
only consume events.

The idea is etcd's Watcher (client/v3/watch.go): a watch is a view of the state that the client keeps current
across broken streams, not a single stream. Reconnects back off exponentially with jitter and a cap (the shared
`RetryPolicy`), and retry until the caller stops iterating or, when `max_wait_seconds` is given, until the head
has been unreachable that long, or at `until` (a time.monotonic() value); then the last error is raised. A
client of several heads follows the next one when the head it watched goes away (gym_rpc.client.control._heads),
and the watch starts there from that head's snapshot: revisions are each head's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from typing import Generic, TypeVar, overload

import grpc

from gym_rpc.client.control._clients import ControlClient, SyncControlClient, WatchEvent
from gym_rpc.client.resend import RetryPolicy
from gym_rpc.errors import ControlPlaneError, HeadUnreachableError
from gym_rpc.wire import StatusReport

# Reconnects start quickly (a head restart takes about a second) and settle at one try every 5 s.
WATCH_RETRY_POLICY = RetryPolicy(initial_backoff_seconds=0.2, max_backoff_seconds=5.0)

# Worth waiting out: the head is down or restarting, or it serves as many watches as it allows right now.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

RetryCallback = Callable[[ControlPlaneError, float], None]


Client = TypeVar("Client", SyncControlClient, ControlClient)


class _Watch(Generic[Client]):
    """The merged view a watch keeps across reconnects, and when to give up; shared by both flavours."""

    def __init__(
        self,
        client: Client,
        *,
        start_revision: int = 0,
        heartbeat_seconds: float | None = None,
        max_wait_seconds: float | None = None,
        until: float | None = None,
        retry: RetryPolicy = WATCH_RETRY_POLICY,
        on_retry: RetryCallback | None = None,
        engine_load: bool = False,
    ) -> None:
        self._client: Client = client
        self._heartbeat_seconds = heartbeat_seconds
        self._engine_load = engine_load  # also "engine_load" events (they change no revision)
        self.revision = start_revision
        self.reports: dict[str, StatusReport] = {}  # server name -> latest report, as of `revision`
        self._max_wait_seconds = max_wait_seconds
        self._until = until  # time.monotonic() at which the watch ends, connected or not
        self._retry = retry
        self._on_retry = on_retry
        self._failures = 0
        self._outage_started: float | None = None
        # The head whose revisions `revision` counts (of several heads, the one the client follows): revisions
        # are each head's own, so a watch that moves to another head starts there from its snapshot. (A head
        # answers another head's revision with a snapshot too, as long as its own counter, which starts at its
        # start time in ms, has not passed that revision; starting from 0 does not depend on it.)
        self.source: str | None = None

    def _apply(self, event: WatchEvent) -> WatchEvent:
        """Fold one event into the view; any event means the head is back."""
        self._failures = 0
        self._outage_started = None
        if event.kind == "snapshot":
            self.reports = {}
        self.reports.update((r.server_name, r) for r in event.reports)
        self.revision = event.revision
        return event

    def _start_revision(self) -> int:
        """The revision to resume from at the head followed now: 0 (its snapshot) when that is another head."""
        following = self._client.following()
        if self.source is not None and following != self.source:
            self.revision = 0
        self.source = following
        return self.revision

    @overload
    def _open(self: _Watch[SyncControlClient]) -> Generator[WatchEvent, None, None]: ...
    @overload
    def _open(self: _Watch[ControlClient]) -> AsyncGenerator[WatchEvent, None]: ...
    def _open(self) -> Generator[WatchEvent, None, None] | AsyncGenerator[WatchEvent, None]:
        """A new stream of the head's events, from where the view stands."""
        return self._client.watch_server_statuses(
            self._start_revision(),
            heartbeat_seconds=self._heartbeat_seconds,
            timeout=self._stream_timeout(),
            engine_load=self._engine_load,
        )

    def _stream_timeout(self) -> float | None:
        """What is left until `until`: a connected stream ends then too (DEADLINE_EXCEEDED, not retried)."""
        return None if self._until is None else max(0.001, self._until - time.monotonic())

    def _ended(self) -> HeadUnreachableError:
        """A stream the head ended without an error (it shut down gracefully): as good as gone."""
        address = self.source or self._client.address
        message = f"head server at {address} ended the status watch"
        return HeadUnreachableError(message, address=address, code=grpc.StatusCode.UNAVAILABLE)

    def _pause_after(self, error: ControlPlaneError) -> float:
        """Seconds to wait before reconnecting; raises `error` when it is not worth waiting out or the outage
        has lasted `max_wait_seconds`."""
        if error.code not in RETRYABLE_CODES:
            raise error
        if self.source is not None:
            self._client.skip(self.source)  # of several heads, the next one is tried (a no-op with one)
        now = time.monotonic()
        if self._outage_started is None:
            self._outage_started = now
        give_up_at = self._until if self._until is not None else float("inf")
        if self._max_wait_seconds is not None:
            give_up_at = min(give_up_at, self._outage_started + self._max_wait_seconds)
        if now >= give_up_at:
            raise error
        self._failures += 1
        pause = min(self._retry.backoff_seconds(self._failures), give_up_at - now)
        if self._on_retry is not None:
            self._on_retry(error, pause)
        return pause


class SyncStatusWatch(_Watch[SyncControlClient]):
    """Blocking: `for event in SyncStatusWatch(client): ...`; `reports` and `revision` are the merged view."""

    def __iter__(self) -> Iterator[WatchEvent]:
        while True:
            stream = self._open()
            try:
                for event in stream:
                    yield self._apply(event)
                raise self._ended()
            except ControlPlaneError as error:
                time.sleep(self._pause_after(error))
            finally:
                stream.close()


class StatusWatch(_Watch[ControlClient]):
    """asyncio: `async for event in StatusWatch(client): ...`; `reports` and `revision` are the merged view."""

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self.events()

    async def events(self) -> AsyncGenerator[WatchEvent, None]:
        """The events, as an async generator (for `contextlib.aclosing`: a caller that stops early closes its
        stream at once)."""
        while True:
            stream = self._open()
            try:
                async for event in stream:
                    yield self._apply(event)
                raise self._ended()
            except ControlPlaneError as error:
                await asyncio.sleep(self._pause_after(error))
            finally:
                await stream.aclose()
