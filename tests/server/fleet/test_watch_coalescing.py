"""Coalesced pushes on a real head: changes close together reach each watcher as one message (a debounce with an
upper bound), encoded once for all of them, and a lone change still goes out at once."""

from __future__ import annotations

import asyncio
import math
import os
import time

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.server._head import HeadServer
from gym_rpc.server.fleet._pushes import Pushes
from gym_rpc.wire import WatchEvent
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK
from tests.support.waiting import eventually

NAME = "policy_model"
WATCHERS = 20
CHANGES = 200


async def _relabel_storm(client: ControlClient, port: int, changes: int) -> float:
    """`changes` registrations of one process at one address, each with new labels: each is one revision. The
    seconds the storm took."""
    started = time.monotonic()
    for index in range(changes):
        await client.register_instance(
            NAME, listen_port=port, listen_host=LOOPBACK, pid=os.getpid(), labels={"step": str(index)}
        )
    return time.monotonic() - started


async def _quiet(head: HeadServer) -> None:
    """Until every revision is pushed and nothing has been pushed for the quiet time."""
    pushes = head.prober.pushes
    deadline = time.monotonic() + 30
    while pushes.revision != head.prober.revision:
        assert time.monotonic() < deadline, "the head never pushed its last revision"
        await asyncio.sleep(0.01)
    await asyncio.sleep(pushes.quiet_seconds + 0.1)


def _step(event: WatchEvent) -> str | None:
    """The `step` label the registered instance carries in this event, if the event reports it."""
    for report in event.reports:
        for instance in report.instances:
            if instance.labels.get("step") is not None:
                return instance.labels["step"]
    return None


async def _events_until(stream: object, last_step: str, timeout: float) -> list[WatchEvent]:
    """A watcher's change events until it reports `last_step`."""
    events: list[WatchEvent] = []
    deadline = time.monotonic() + timeout
    async for event in stream:  # type: ignore[attr-defined]
        if event.kind != "heartbeat":
            events.append(event)
        if _step(event) == last_step:
            return events
        assert time.monotonic() < deadline, f"the watcher never heard step {last_step}"
    raise AssertionError("the watch ended")


async def test_a_storm_of_changes_reaches_each_watcher_as_a_few_merged_messages(head_factory, http_server):
    replica = await http_server()
    # a quiet time of 0.5 s, not the default 50 ms: at a load average of 13 the storm's own registrations had gaps
    # longer than 50 ms, each of which let a push out (14 messages where 7 were the bound)
    head: HeadServer = await head_factory(
        document({NAME: server_entry(await http_server())}), push_quiet_seconds=0.5, push_max_delay_seconds=1.0
    )
    client = ControlClient(head.address)
    streams = [client.watch_server_statuses(heartbeat_seconds=60) for _ in range(WATCHERS)]
    try:
        firsts = await asyncio.gather(*(asyncio.wait_for(anext(s), 10) for s in streams))
        assert {event.kind for event in firsts} == {"snapshot"}
        assert head._servicer is not None
        feed, pushes = head._servicer.watch_feed, head.prober.pushes
        encoded, pushed, revision = feed.encoded, pushes.pushed, head.prober.revision

        heard = asyncio.gather(*(_events_until(s, str(CHANGES - 1), 60) for s in streams))
        seconds = await _relabel_storm(client, replica, CHANGES)
        per_watcher = await asyncio.wait_for(heard, 60)
    finally:
        for stream in streams:
            await stream.aclose()

    assert head.prober.revision - revision >= CHANGES  # every registration was a revision of its own
    # A push at the storm's first change, one at least every max delay while it lasts, one after it ends (and a
    # probe result may land in between).
    most = 3 + math.ceil(seconds / pushes.max_delay_seconds)
    counts = [len(events) for events in per_watcher]
    assert max(counts) <= most, (counts, seconds)
    assert {events[-1].revision for events in per_watcher} == {pushes.revision}
    # Each push was encoded once for all twenty watchers: a message per watcher would be twenty times as many.
    assert feed.encoded - encoded <= pushes.pushed - pushed + 2, (feed.encoded - encoded, pushes.pushed - pushed)


async def test_a_lone_change_is_pushed_at_once(head_factory, http_server):
    """After a quiet spell a change is not held for the debounce: it is pushed as it is made (before the
    registration that made it returns), and the watcher hears it."""
    replica = await http_server()
    head = await head_factory(
        document({NAME: server_entry(await http_server())}),
        push_quiet_seconds=2.0,
        push_max_delay_seconds=10.0,
        probe_interval_seconds=3600.0,
    )
    client = ControlClient(head.address)
    stream = client.watch_server_statuses(heartbeat_seconds=60)
    try:
        await asyncio.wait_for(anext(stream), 10)
        await _quiet(head)  # a quiet spell: nothing pushed for the quiet time
        await _relabel_storm(client, replica, 1)
        assert head.prober.pushes.revision == head.prober.revision  # pushed, not held
        events = await asyncio.wait_for(_events_until(stream, "0", 30), 30)
    finally:
        await stream.aclose()
    assert [event.kind for event in events] == ["change"]


async def test_changes_after_a_push_are_held_until_quiet_then_merged(head_factory, http_server):
    """Two changes right after a push: held until nothing changed for the quiet time, then one merged message
    carrying the later one."""
    replica = await http_server()
    head = await head_factory(
        document({NAME: server_entry(await http_server())}),
        push_quiet_seconds=0.5,
        push_max_delay_seconds=5.0,
        probe_interval_seconds=3600.0,
    )
    client = ControlClient(head.address)
    stream = client.watch_server_statuses(heartbeat_seconds=60)
    try:
        await asyncio.wait_for(anext(stream), 10)
        await _quiet(head)
        await _relabel_storm(client, replica, 3)  # the first goes out at once; the next two are held
        assert head.prober.pushes.revision < head.prober.revision
        events = await asyncio.wait_for(_events_until(stream, "2", 30), 20)
    finally:
        await stream.aclose()
    assert [_step(event) for event in events] == ["0", "2"]


async def test_a_push_wakes_every_waiting_watcher_and_a_cancelled_one_disturbs_none() -> None:
    """`Pushes.wake`: each watcher awaits a future of its own (thousands wait at once, with no timer each); a push
    wakes them all with True, the tick of their period with False, and a watcher cancelled meanwhile (its client
    went away) neither cancels nor wakes the others."""
    revision = [1]
    pushes = Pushes(lambda: revision[0], quiet_seconds=0.0)
    waiters = [asyncio.ensure_future(pushes.wake(3600.0)) for _ in range(3)]
    await asyncio.sleep(0)
    waiters[0].cancel()
    await asyncio.sleep(0)
    assert not waiters[1].done() and not waiters[2].done()
    revision[0] = 2
    pushes.changed()
    assert list(await asyncio.gather(waiters[1], waiters[2])) == [True, True]
    assert waiters[0].cancelled()
    assert await pushes.wake(0.01) is False  # the tick of its period, no push meanwhile


async def test_a_change_made_while_watchers_still_write_the_last_push_waits_until_they_are_back() -> None:
    """The debounce's clock starts when the watchers woken by a push have written it: a change made while they are
    still writing is held (however long they take), and pushed a quiet time after they came back to wait. Pushed
    at once instead, every push carried the one registration the head's loop took while writing the last."""
    revision = [1]
    pushes = Pushes(lambda: revision[0], quiet_seconds=0.01, max_delay_seconds=3600.0)
    waiters = [pushes.wake(3600.0) for _ in range(3)]
    revision[0] = 2
    pushes.changed()  # a lone change after a quiet spell: pushed at once
    assert pushes.revision == 2 and [w.result() for w in waiters] == [True, True, True]
    revision[0] = 3
    pushes.changed()  # the three are still writing revision 2
    await asyncio.sleep(0.1)  # ten quiet times: the debounce alone would have pushed it
    assert pushes.revision == 2
    back = [pushes.wake(3600.0) for _ in range(3)]  # each wrote it and waits again
    await eventually(lambda: pushes.revision, lambda pushed: pushed == 3, within=10, what="the held push")
    assert [await w for w in back] == [True, True, True]


async def test_a_push_none_of_whose_watchers_is_back_yet_is_waited_for_past_the_max_delay() -> None:
    """The loop's first pass over 10,000 woken watchers (each building and handing its write to gRPC) can outlast
    the max delay on a loaded machine before any comes back: that push is still being written, and a change made
    meanwhile waits for it (pushed after the max delay instead, at W = 10,000 a storm's pushes went back to back
    again: 34-40 messages per watcher, 33 s to register)."""
    revision = [1]
    pushes = Pushes(lambda: revision[0], quiet_seconds=0.01, max_delay_seconds=0.02)
    waiters = [pushes.wake(3600.0) for _ in range(2)]
    revision[0] = 2
    pushes.changed()
    assert [w.result() for w in waiters] == [True, True]
    revision[0] = 3
    pushes.changed()
    await asyncio.sleep(0.2)  # ten max delays, nobody back
    assert pushes.revision == 2
    back = [pushes.wake(3600.0) for _ in range(2)]
    await eventually(lambda: pushes.revision, lambda pushed: pushed == 3, within=10, what="the held push")
    assert [await w for w in back] == [True, True]


async def test_watchers_that_never_come_back_from_a_push_are_not_waited_for() -> None:
    """A watcher whose stream ended while it wrote never waits again: once the others are back, a held change goes
    out when nobody else came back for the max delay."""
    revision = [1]
    pushes = Pushes(lambda: revision[0], quiet_seconds=0.01, max_delay_seconds=0.1)
    gone, other = pushes.wake(3600.0), pushes.wake(3600.0)
    revision[0] = 2
    pushes.changed()
    assert gone.result() is True and other.result() is True
    revision[0] = 3
    pushes.changed()
    again = pushes.wake(3600.0)  # the other one wrote it and waits again; the gone one never does
    await eventually(lambda: pushes.revision, lambda pushed: pushed == 3, within=10, what="the held push")
    assert await again is True
    assert await pushes.wake(0.01) is False  # nothing more to push: the tick
