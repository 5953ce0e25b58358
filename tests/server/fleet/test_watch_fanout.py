"""Watch fan-out on a real head: one message per change, built and serialised once for every watcher, and a
watcher that lags past the head's history gets a compacted snapshot instead of a backlog."""

from __future__ import annotations

import asyncio

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.server.service._servicer import ControlPlaneServicer, WatchStream
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import RegistrationState
from gym_rpc.wire._convert import seconds_to_duration
from tests.support.documents import document, server_entry
from tests.support.heads import wait_for_status
from tests.support.prober import registered_as
from tests.support.servers import start_stoppable_server

WATCHERS = 40


async def test_one_serialised_message_per_change_is_shared_by_all_watchers(head_factory):
    runner, port = await start_stoppable_server()
    try:
        head = await head_factory(document({"live": server_entry(port)}))
        await wait_for_status(head, "live", "success")
        client = ControlClient(head.address)
        streams = [client.watch_server_statuses(heartbeat_seconds=60) for _ in range(WATCHERS)]
        snapshots = await asyncio.gather(*(asyncio.wait_for(anext(s), 10) for s in streams))
        assert {s.kind for s in snapshots} == {"snapshot"}
        assert len({s.revision for s in snapshots}) == 1  # all watchers stand at one revision
        assert head._servicer is not None
        feed = head._servicer.watch_feed
        built, encoded = feed.built, feed.encoded

        await runner.cleanup()  # the server dies: one change for every watcher
        changes = await asyncio.gather(*(asyncio.wait_for(anext(s), 10) for s in streams))
    finally:
        await runner.cleanup()
        for stream in streams:
            await stream.aclose()

    assert {(c.kind, c.revision) for c in changes} == {("change", snapshots[0].revision + 1)}
    assert {(r.server_name, r.status) for c in changes for r in c.reports} == {("live", "connection_error")}
    assert (feed.built - built, feed.encoded - encoded) == (1, 1)  # 40 watchers, one message, one encoding


async def test_a_watcher_lagging_past_the_history_gets_a_compacted_snapshot(head_factory, http_server):
    head = await head_factory(
        document({"live": server_entry(await http_server())}), probe_interval_seconds=3600.0, watch_history_size=4
    )
    await wait_for_status(head, "live", "success")
    servicer = ControlPlaneServicer(head)
    request = pb.WatchServerStatusesRequest()
    request.heartbeat_interval.CopyFrom(seconds_to_duration(60))
    stream = WatchStream(servicer.watch_feed, request)
    snapshot = await stream.next()
    # The watcher reads nothing while six changes land: more than the history of four keeps.
    states: list[RegistrationState] = ["registered", "deregistered"] * 3
    for state in states:
        await head.prober.set_instances("live", registered_as(head.config.servers["live"], state))
    caught_up = await asyncio.wait_for(stream.next(), 5)
    assert (caught_up.type, caught_up.compacted) == (pb.WATCH_EVENT_TYPE_SNAPSHOT, True)
    assert caught_up.revision == snapshot.revision + 6 == head.prober.revision
    assert [(r.server_name, r.registration) for r in caught_up.reports] == [
        ("live", pb.REGISTRATION_STATE_DEREGISTERED)
    ]

    # Two changes the history still holds: one merged CHANGE, the latest report per server.
    await head.prober.set_instances(
        "live", registered_as(head.config.servers["live"], "registered", "http://127.0.0.1:1")
    )
    await head.prober.set_instances("live", registered_as(head.config.servers["live"], "expired"))
    merged = await asyncio.wait_for(stream.next(), 5)
    assert (merged.type, merged.compacted, merged.revision) == (
        pb.WATCH_EVENT_TYPE_CHANGE,
        False,
        caught_up.revision + 2,
    )
    assert [(r.server_name, r.registration) for r in merged.reports] == [("live", pb.REGISTRATION_STATE_EXPIRED)]
