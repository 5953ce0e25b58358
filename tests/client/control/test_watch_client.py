"""The library's status watch (gym_rpc.client.control._watch) against real heads: it waits for a head, resumes
across a restart, waits out RESOURCE_EXHAUSTED, gives up after max_wait, and raises what is not worth waiting
out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from gym_rpc.client.control._clients import ControlClient, SyncControlClient, WatchEvent
from gym_rpc.client.control._credentials import ClientSecurity
from gym_rpc.client.control._watch import RETRYABLE_CODES, StatusWatch, SyncStatusWatch
from gym_rpc.client.resend._policy import RetryPolicy
from gym_rpc.errors import ControlPlaneError, HeadUnreachableError
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

FAST_RETRY = RetryPolicy(initial_backoff_seconds=0.05, max_backoff_seconds=0.2)
WAIT_SECONDS = 10.0  # generous: a loaded machine, and the head restarts in between


class Retries:
    """Records what the watch reported before each reconnect."""

    def __init__(self) -> None:
        self.calls: list[tuple[grpc.StatusCode, float]] = []

    def __call__(self, error: ControlPlaneError, pause: float) -> None:
        self.calls.append((error.code, pause))


async def next_event(events: AsyncIterator[WatchEvent]) -> WatchEvent:
    return await asyncio.wait_for(anext(events), WAIT_SECONDS)


async def test_resumes_across_a_head_restart_on_the_same_port(head_factory, http_server) -> None:
    port = closed_port()
    doc = document({"up": server_entry(await http_server())})
    head = await head_factory(doc, port=port)
    retries = Retries()
    watch = StatusWatch(ControlClient(head.address), heartbeat_seconds=0.1, retry=FAST_RETRY, on_retry=retries)
    events = aiter(watch)
    first = await next_event(events)
    assert first.kind == "snapshot"
    assert set(watch.reports) == {"up"}
    assert watch.revision == first.revision

    await head.stop()
    await head_factory(doc, port=port)
    event = await next_event(events)
    while event.kind == "heartbeat":  # a heartbeat may still come from the old stream before it breaks
        event = await next_event(events)
    # The new head's revisions began at its own start: the old one is unknown to it, so it sends a whole view.
    assert event.kind == "snapshot"
    assert event.compacted is True
    assert event.revision > first.revision
    assert set(watch.reports) == {"up"}
    assert retries.calls, "the watch reconnected without reporting the outage"
    assert {code for code, _ in retries.calls} <= {grpc.StatusCode.UNAVAILABLE}
    await events.aclose()  # type: ignore[attr-defined]


async def test_waits_out_resource_exhausted(head_factory) -> None:
    head = await head_factory(document({}), max_concurrent_watches=1)
    client = ControlClient(head.address)
    holder = client.watch_server_statuses(heartbeat_seconds=0.1)
    assert (await next_event(holder)).kind == "snapshot"

    retries = Retries()
    events = aiter(StatusWatch(client, retry=FAST_RETRY, on_retry=retries))
    waiting = asyncio.ensure_future(next_event(events))
    while not retries.calls:  # bounded by the test's own timeout below
        await asyncio.wait_for(asyncio.shield(asyncio.sleep(0.05)), WAIT_SECONDS)
    assert not waiting.done()
    assert retries.calls[0][0] == grpc.StatusCode.RESOURCE_EXHAUSTED

    await holder.aclose()  # the slot comes free: the waiting watch gets in
    assert (await waiting).kind == "snapshot"
    await events.aclose()  # type: ignore[attr-defined]


async def test_gives_up_after_max_wait_with_the_last_error() -> None:
    retries = Retries()
    address = f"{LOOPBACK}:{closed_port()}"
    watch = StatusWatch(ControlClient(address), max_wait_seconds=0.5, retry=FAST_RETRY, on_retry=retries)
    started = time.monotonic()
    with pytest.raises(HeadUnreachableError, match=address):
        async for _ in watch:
            pass
    assert time.monotonic() - started >= 0.5
    assert len(retries.calls) >= 1
    # Pauses are capped by the policy and never run past the max-wait.
    assert all(0 < pause <= 0.2 for _, pause in retries.calls)


async def test_an_error_not_worth_waiting_out_is_raised_at_once(head_factory) -> None:
    head_server = {"host": LOOPBACK, "port": 0, "auth_token": "s3cret-watch-token"}
    head = await head_factory(document({}, head_server=head_server))
    retries = Retries()
    watch = StatusWatch(ControlClient(head.address, security=ClientSecurity()), on_retry=retries)
    with pytest.raises(ControlPlaneError, match="UNAUTHENTICATED") as caught:
        async for _ in watch:
            pass
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    # A loaded machine may fail the first connect (UNAVAILABLE is waited out); UNAUTHENTICATED never is.
    assert grpc.StatusCode.UNAUTHENTICATED not in {code for code, _ in retries.calls}


def test_sync_watch_gives_up_after_max_wait() -> None:
    retries = Retries()
    address = f"{LOOPBACK}:{closed_port()}"
    watch = SyncStatusWatch(SyncControlClient(address), max_wait_seconds=0.3, retry=FAST_RETRY, on_retry=retries)
    with pytest.raises(HeadUnreachableError, match=address):
        for _ in watch:
            pass
    assert retries.calls and {code for code, _ in retries.calls} == {grpc.StatusCode.UNAVAILABLE}


async def test_sync_watch_reads_the_view_from_a_head(head_factory, http_server) -> None:
    head = await head_factory(document({"up": server_entry(await http_server())}))

    def first_success() -> tuple[int, str | None]:
        watch = SyncStatusWatch(SyncControlClient(head.address), heartbeat_seconds=0.1)
        events = iter(watch)
        for _ in range(200):  # bounded: the prober reports within a few 0.1 s rounds
            next(events)
            if watch.reports["up"].status == "success":
                break
        events.close()  # type: ignore[attr-defined]
        return watch.revision, watch.reports["up"].status

    revision, status = await asyncio.wait_for(asyncio.to_thread(first_success), WAIT_SECONDS * 2)
    assert status == "success"
    assert revision > 0


def test_only_unavailable_and_resource_exhausted_are_waited_out() -> None:
    assert {code.name for code in RETRYABLE_CODES} == {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
