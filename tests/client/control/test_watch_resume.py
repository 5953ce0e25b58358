"""The watch client's resume, exactly: from a revision with heartbeats, ending at `until`, the view it keeps,
and its reconnect pauses, for the blocking and the async client alike.

Found by mutation testing (`make mutate`, bench/MUTATION.md; these tests were tests/test_exact_behaviour.py):
exact answers no other test pinned down. Each test names the mutant class it kills: a change to the code
that left the rest of the suite green.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
import yaml

from gym_rpc.client import ControlClient, SyncControlClient
from gym_rpc.client.control._watch import StatusWatch, SyncStatusWatch
from gym_rpc.client.resend._policy import RetryPolicy
from gym_rpc.errors import (
    ControlPlaneError,
    HeadUnreachableError,
)
from gym_rpc.wire import WatchEvent
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

WatchFactory = Callable[..., Awaitable[list[WatchEvent]]]


async def _sync_events(address: str, count: int, **options: Any) -> list[WatchEvent]:
    """Up to `count` events of a SyncStatusWatch (in a thread); the error that ended it propagates."""

    def read() -> list[WatchEvent]:
        return list(itertools.islice(SyncStatusWatch(SyncControlClient(address), **options), count))

    return await asyncio.wait_for(asyncio.to_thread(read), 30)  # a hang guard, far past every bound used


async def _async_events(address: str, count: int, **options: Any) -> list[WatchEvent]:
    async def read() -> list[WatchEvent]:
        events: list[WatchEvent] = []
        async for event in StatusWatch(ControlClient(address), **options):
            events.append(event)
            if len(events) == count:
                break
        return events

    return await asyncio.wait_for(read(), 30)


FLAVOURS = pytest.mark.parametrize("events_of", [_sync_events, _async_events], ids=["sync", "async"])


@FLAVOURS
async def test_a_watch_from_the_current_revision_resumes_with_heartbeats(
    head_factory, events_of: WatchFactory
) -> None:
    """StatusWatch/SyncStatusWatch pass start_revision and heartbeat_seconds on: from the head's current revision
    the first events are heartbeats (nothing was missed), every 0.2 s; from the default the first is a plain
    (not compacted) snapshot."""
    head = await head_factory(document({"gone": server_entry(closed_port())}), probe_interval_seconds=3600)
    revision = (await ControlClient(head.address).list_server_statuses()).revision
    started = time.monotonic()
    resumed = await events_of(head.address, 2, start_revision=revision, heartbeat_seconds=0.2)
    assert [(event.kind, event.revision) for event in resumed] == [("heartbeat", revision)] * 2
    assert time.monotonic() - started < 4.0  # two at 0.2 s, where the head's default of 5 s would take 10 s
    fresh = await events_of(head.address, 1, heartbeat_seconds=0.2)
    assert (fresh[0].kind, fresh[0].compacted, fresh[0].revision) == ("snapshot", False, revision)


@FLAVOURS
async def test_a_watch_ends_at_until_connected_or_not(head_factory, events_of: WatchFactory) -> None:
    """`until`: a connected stream gets the time left as its deadline (DEADLINE_EXCEEDED, not retried)."""
    head = await head_factory(document({"gone": server_entry(closed_port())}), probe_interval_seconds=3600)
    with pytest.raises(ControlPlaneError) as ended:
        await events_of(head.address, 1000, heartbeat_seconds=0.1, until=time.monotonic() + 0.5)
    assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_a_watch_gives_up_at_until_while_the_head_is_unreachable() -> None:
    address = f"{LOOPBACK}:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(HeadUnreachableError):
        await _sync_events(address, 1, until=started + 0.5)
    assert time.monotonic() - started >= 0.45  # it waited for the head until then


async def test_the_view_follows_changes_and_a_fresh_snapshot_replaces_it(head_factory, http_server) -> None:
    """_apply: a change updates its servers and keeps the others; a snapshot (here after a reload removed a
    server) replaces the whole view; the revision is the last event's."""
    up, down = await http_server(), closed_port()
    head = await head_factory(document({"up": server_entry(up), "down": server_entry(down)}))
    watch = StatusWatch(ControlClient(head.address), heartbeat_seconds=60)
    events = watch.__aiter__()
    async with asyncio.timeout(30):
        while {name: report.status for name, report in watch.reports.items()} != {
            "up": "success",
            "down": "connection_error",
        }:
            await anext(events)
        assert head.config_path is not None
        head.config_path.write_text(
            yaml.safe_dump(document({"up": server_entry(up)}), sort_keys=False), encoding="utf-8"
        )
        assert await head.reload() is True
        event = await anext(events)
        while event.kind != "snapshot":
            event = await anext(events)
    assert set(watch.reports) == {"up"} and watch.revision == event.revision
    await events.aclose()  # type: ignore[attr-defined]  # an async generator


async def test_reconnect_pauses_back_off_from_the_first_after_every_event_and_stop_at_max_wait(
    head_factory,
) -> None:
    """_pause_after: the n-th failure in a row pauses backoff(n) (an event resets n), capped so that the pauses of
    one outage end at max_wait_seconds, when the last error is raised."""
    head = await head_factory(document({}), probe_interval_seconds=3600)
    pauses: list[float] = []
    policy = RetryPolicy(initial_backoff_seconds=0.1, multiplier=10.0, max_backoff_seconds=5.0)
    client = SyncControlClient(head.address)

    def read() -> list[WatchEvent]:
        watch = SyncStatusWatch(
            client,
            heartbeat_seconds=0.1,
            max_wait_seconds=3.0,
            retry=policy,
            on_retry=lambda _, p: pauses.append(p),
        )
        seen = []
        for event in watch:
            seen.append(event)
            if len(seen) == 2:
                asyncio.run_coroutine_threadsafe(head.stop(), loop).result(30)
        return seen

    loop = asyncio.get_running_loop()
    with pytest.raises(HeadUnreachableError):
        await asyncio.wait_for(asyncio.to_thread(read), 30)
    assert len(pauses) >= 3, pauses
    assert 0.05 <= pauses[0] <= 0.1 and 0.5 <= pauses[1] <= 1.0, pauses  # backoff(1), backoff(2)
    assert sum(pauses) <= 3.0, pauses  # the last pause ends where max_wait_seconds does


async def _end_at_once(request: bytes, context: object) -> AsyncIterator[bytes]:
    """A status watch that a control plane other than gym_rpc's head (which never does) ends without an error."""
    return
    yield


@FLAVOURS
async def test_a_watch_the_head_ends_without_an_error_is_an_outage_named_as_such(events_of: WatchFactory) -> None:
    watch = grpc.unary_stream_rpc_method_handler(_end_at_once)  # bytes in and out: no message is ever sent
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("gym_rpc.v1.ControlPlaneService", {"WatchServerStatuses": watch}),)
    )
    address = f"{LOOPBACK}:{server.add_insecure_port(f'{LOOPBACK}:0')}"
    await server.start()
    retried: list[ControlPlaneError] = []
    try:
        with pytest.raises(HeadUnreachableError) as ended:
            await events_of(address, 1, max_wait_seconds=0.3, on_retry=lambda error, _: retried.append(error))
    finally:
        await server.stop(None)
    assert (str(ended.value), ended.value.address, ended.value.code) == (
        f"head server at {address} ended the status watch",
        address,
        grpc.StatusCode.UNAVAILABLE,
    )
    assert retried and {str(error) for error in retried} == {str(ended.value)}


async def test_pauses_before_any_event_start_at_the_first_backoff() -> None:
    """A head down from the start: the first pause is backoff(1) (the count of failures starts at 0)."""
    policy = RetryPolicy(initial_backoff_seconds=0.1, multiplier=10.0, max_backoff_seconds=5.0)
    pauses: list[float] = []
    with pytest.raises(HeadUnreachableError):
        await _async_events(
            f"{LOOPBACK}:{closed_port()}",
            1,
            max_wait_seconds=0.5,
            retry=policy,
            on_retry=lambda _, p: pauses.append(p),
        )
    assert 0.05 <= pauses[0] <= 0.1, pauses
