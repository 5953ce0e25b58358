"""The standard `grpc.health.v1.Health` service (Check, Watch, List), which no watcher can block.

grpc's reference asyncio servicer writes to each watcher while holding the lock its `set()` needs, so one watcher
that stops reading (HTTP/2 window 0) blocks every `set()`: the prober that mirrors statuses into health, and the
shutdown that reports NOT_SERVING. Here the table of statuses is the only shared state: `set()` changes it and
wakes each watcher of that service (an Event each, its latest-value slot: a watcher always sends the status the
table holds when it gets to write, so it never queues more than one), and awaits nothing. Each Watch writes on its
own, bounded by the stall limit (gym_rpc.server.security._watch_slots); Watch is open to everyone (probes carry no
token), so watches are capped per client address and in total, as status watches are. It also answers `List`, which
grpc's servicer leaves UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_rpc.errors import quoted
from gym_rpc.server.security import DEFAULT_STALL_SECONDS, PeerMap, WatchSlots, peer_address, write_all_or_drop

MAX_LISTED_SERVICES = 10_000  # the proto lets a server refuse a list too long to send (RESOURCE_EXHAUSTED)
DEFAULT_MAX_HEALTH_WATCHES = 16384  # per head (as status watches: gym_rpc.server.security._auth)
DEFAULT_MAX_HEALTH_WATCHES_PER_PEER = 1024  # per client address

ServingStatus = Any  # health_pb2.HealthCheckResponse.ServingStatus (an int enum)
Context = grpc.aio.ServicerContext[Any, Any]
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Serving state per service name ("" is the head itself); `set` never waits for a watcher."""

    def __init__(
        self,
        *,
        max_watches: int = DEFAULT_MAX_HEALTH_WATCHES,
        max_watches_per_peer: int = DEFAULT_MAX_HEALTH_WATCHES_PER_PEER,
        stall_seconds: float = DEFAULT_STALL_SECONDS,
        peers: PeerMap | None = None,
    ) -> None:
        self._statuses: dict[str, ServingStatus] = {"": _SERVING}
        self._watchers: dict[str, set[asyncio.Event]] = {}  # service -> each watcher's "changed" slot
        self._shutting_down = False
        self.slots = WatchSlots("health watches", max_watches, max_watches_per_peer, instead="poll Check")
        self.stall_seconds = stall_seconds
        self.peers = peers if peers is not None else PeerMap()  # who is behind a relayed connection

    async def set(self, service: str, status: ServingStatus) -> None:
        """Serve `status` for `service` from now on (ignored once shutting down). Never waits: it only tells each
        watcher of `service` to look again (async for grpc's servicer's signature)."""
        if not self._shutting_down:
            self._set(service, status)

    def _set(self, service: str, status: ServingStatus) -> None:
        if self._statuses.get(service) == status:
            return
        self._statuses[service] = status
        for changed in self._watchers.get(service, ()):
            changed.set()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good: later `set` calls are ignored."""
        self._shutting_down = True
        for service in list(self._statuses):
            self._set(service, _NOT_SERVING)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {quoted(request.service)}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Context) -> None:
        """The service's status now, then each change (intermediate ones may be skipped: the latest is sent)."""
        peer = self.peers.caller(context)
        key = await self.slots.take_or_abort(context, peer_address(peer))
        try:
            await write_all_or_drop(context, self._changes(request.service), self.stall_seconds, peer)
        finally:
            self.slots.release(key)

    async def _changes(self, service: str) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The service's status now and after each change; a change made while the last one was being written
        is not queued: the status the table holds next is."""
        changed = asyncio.Event()
        self._watchers.setdefault(service, set()).add(changed)
        try:
            sent = None
            while True:
                changed.clear()
                status = self._statuses.get(service, _SERVICE_UNKNOWN)
                if status != sent:
                    yield health_pb2.HealthCheckResponse(status=status)
                    sent = status
                else:
                    await changed.wait()
        finally:
            watchers = self._watchers[service]
            watchers.discard(changed)
            if not watchers:
                del self._watchers[service]

    async def List(self, request: health_pb2.HealthListRequest, context: Context) -> health_pb2.HealthListResponse:
        statuses = dict(self._statuses)  # one table answers Check, Watch and List
        if len(statuses) > MAX_LISTED_SERVICES:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(statuses)} health services, more than {MAX_LISTED_SERVICES} listed at once; use Check",
            )
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()}
        )
