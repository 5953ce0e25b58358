"""Talking to a head under test: raw stubs, its watch (events read within a deadline), its reports and health, and
its config file rewritten for a reload."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_rpc.client.control._channel import aio_channel
from gym_rpc.client.control._clients import ControlClient, WatchEvent
from gym_rpc.server._head import HeadServer
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from gym_rpc.wire import ServerStatus, StatusReport
from tests.support.loopback import LOOPBACK
from tests.support.waiting import eventually


@contextlib.asynccontextmanager
async def watching(
    client: ControlClient, start_revision: int = 0, *, heartbeat_seconds: float
) -> AsyncIterator[AsyncGenerator[WatchEvent, None]]:
    """A status watch that is closed (and its stream cancelled) when the block ends, however it ends."""
    events = client.watch_server_statuses(start_revision, heartbeat_seconds=heartbeat_seconds)
    try:
        yield events
    finally:
        await events.aclose()


async def read_until(
    events: AsyncIterator[WatchEvent], done: Callable[[WatchEvent], bool], timeout: float = 5.0
) -> list[WatchEvent]:
    """Every event up to and including the first one `done` accepts; fails after `timeout`."""
    seen: list[WatchEvent] = []
    deadline = time.monotonic() + timeout
    while not seen or not done(seen[-1]):
        remaining = deadline - time.monotonic()
        try:
            assert remaining > 0
            seen.append(await next_event(events, remaining))
        except (AssertionError, TimeoutError):
            raise AssertionError(f"no matching event within {timeout}s; saw {seen}") from None
    return seen


async def wait_for_status(head: HeadServer, name: str, status: ServerStatus, timeout: float = 5.0) -> None:
    """Until the head's own cache reports `name` with `status` (bounded)."""
    await eventually(
        lambda: head.prober.report(name),
        lambda report: report.status == status,
        within=timeout,
        what=f"{name} {status}",
        every=0.02,
    )


def raw_stub(head: HeadServer) -> pb_grpc.ControlPlaneServiceAsyncStub:
    """The generated stub, to see exactly what goes over the wire (codes, details, raw JSON)."""
    return pb_grpc.ControlPlaneServiceStub(aio_channel(head.address))


async def wait_until_probed(head: HeadServer, deadline_seconds: float = 5.0) -> list[StatusReport]:
    """The head's own cache once every server has a probe result (bounded)."""
    return await eventually(
        head.prober.reports,
        lambda reports: all(r.status is not None for r in reports),
        within=deadline_seconds,
        what="every server probed",
        every=0.02,
    )


def rewrite_config(head: HeadServer, doc: dict[str, Any]) -> None:
    assert head.config_path is not None
    head.config_path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), encoding="utf-8")


def authority(port: int) -> str:
    return f"{LOOPBACK}:{port}"


async def wait_for_report(
    head: HeadServer, holds: Callable[[StatusReport], bool], what: str, timeout: float = 10.0
) -> StatusReport:
    """The head's report of `policy` once `holds` accepts it (bounded)."""
    return await eventually(lambda: head.prober.report("policy"), holds, within=timeout, what=what, every=0.02)


async def health_of(head: HeadServer, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(aio_channel(head.address))
    return int((await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status)


async def next_report(events: AsyncGenerator[WatchEvent, None], timeout: float = 10.0) -> tuple[int, StatusReport]:
    """The next CHANGE of `policy` (its revision and report), skipping heartbeats."""
    seen = await read_until(events, lambda e: e.kind == "change" and bool(e.reports), timeout)
    (report,) = seen[-1].reports
    return seen[-1].revision, report


async def next_event(events: AsyncIterator[WatchEvent], timeout: float = 5.0) -> WatchEvent:
    return await asyncio.wait_for(anext(events), timeout)
