"""WatchServerStatuses against a real head: snapshot, changes, heartbeats, resume and compaction."""

from __future__ import annotations

import asyncio
import time

import yaml

from gym_rpc.client.control._clients import ControlClient, WatchEvent
from gym_rpc.server.service._servicer import ControlPlaneServicer, WatchStream
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import ServerStatus
from gym_rpc.wire._convert import seconds_to_duration
from tests.support.documents import document, server_entry
from tests.support.heads import next_event, read_until, wait_for_status, watching
from tests.support.loopback import closed_port
from tests.support.servers import start_stoppable_server

PROBE_INTERVAL = 0.1
# Scheduling slack on a loaded machine, on top of the one probe interval a change may take to be seen.
SLACK_SECONDS = 1.5


def reports_status(event: WatchEvent, name: str, status: ServerStatus) -> bool:
    return event.kind != "heartbeat" and any(r.server_name == name and r.status == status for r in event.reports)


def assert_revisions_rise(events: list[WatchEvent]) -> None:
    """Snapshots and changes strictly raise the revision; heartbeats repeat the latest, never go back."""
    latest = -1
    for event in events:
        if event.kind == "heartbeat":
            assert event.revision >= latest, events
        else:
            assert event.revision > latest, events
        latest = event.revision


async def test_snapshot_first_then_a_change_when_a_server_stops(head_factory):
    runner, port = await start_stoppable_server()
    try:
        head = await head_factory(
            document({"live": server_entry(port), "closed": server_entry(closed_port(), "resources_servers")}),
            probe_interval_seconds=PROBE_INTERVAL,
        )
        client = ControlClient(head.address)
        async with watching(client, heartbeat_seconds=0.2) as events:
            snapshot = await next_event(events)
            assert snapshot.kind == "snapshot" and not snapshot.compacted
            assert [r.server_name for r in snapshot.reports] == ["live", "closed"]
            seen = [snapshot]
            if not reports_status(snapshot, "live", "success"):
                seen += await read_until(events, lambda e: reports_status(e, "live", "success"))

            await runner.cleanup()
            stopped = time.monotonic()
            seen += await read_until(events, lambda e: reports_status(e, "live", "connection_error"))
            elapsed = time.monotonic() - stopped
            change = seen[-1]
            assert change.kind == "change"
            assert [r.server_name for r in change.reports] == ["live"]  # only what changed
            assert elapsed < PROBE_INTERVAL + SLACK_SECONDS, f"change seen after {elapsed:.2f}s"
            assert_revisions_rise(seen)
            assert change.revision == head.prober.revision
    finally:
        await runner.cleanup()


async def test_heartbeats_carry_the_current_revision(head_factory, http_server):
    head = await head_factory(document({"live": server_entry(await http_server())}))
    await wait_for_status(head, "live", "success")
    client = ControlClient(head.address)
    async with watching(client, heartbeat_seconds=0.1) as events:
        snapshot = await next_event(events)
        assert snapshot.kind == "snapshot"
        started = time.monotonic()
        heartbeats = [await next_event(events, 2.0) for _ in range(3)]
        assert time.monotonic() - started < 2.0
    assert [e.kind for e in heartbeats] == ["heartbeat"] * 3  # the status holds, so nothing else is sent
    assert {e.revision for e in heartbeats} == {snapshot.revision} == {head.prober.revision}
    assert all(not e.reports for e in heartbeats)


async def test_resume_replays_only_later_changes(head_factory):
    runner, port = await start_stoppable_server()
    try:
        head = await head_factory(
            document({"live": server_entry(port), "closed": server_entry(closed_port(), "resources_servers")})
        )
        await wait_for_status(head, "live", "success")
        await wait_for_status(head, "closed", "connection_error")
        resume_from = head.prober.revision
        await runner.cleanup()
        await wait_for_status(head, "live", "connection_error")

        client = ControlClient(head.address)
        async with watching(client, resume_from, heartbeat_seconds=0.1) as events:
            replay = await next_event(events)
        assert replay.kind == "change" and not replay.compacted  # no snapshot: history still has it
        assert replay.revision == head.prober.revision > resume_from
        assert [(r.server_name, r.status) for r in replay.reports] == [("live", "connection_error")]

        current = head.prober.revision
        async with watching(client, current, heartbeat_seconds=0.1) as events:
            up_to_date = await next_event(events)
        assert (up_to_date.kind, up_to_date.revision) == ("heartbeat", current)  # nothing to replay
    finally:
        await runner.cleanup()


async def test_resume_older_than_history_gets_a_compacted_snapshot(head_factory):
    names = ["a", "b", "c"]
    head = await head_factory(
        document({name: server_entry(closed_port()) for name in names}), watch_history_size=2
    )
    for name in names:
        await wait_for_status(head, name, "connection_error")
    # 3 unprobed entries, then 3 first results: six changes, of which the history keeps the last two.
    current = head.prober.revision
    assert [revision for revision, _ in head.prober._history] == [current - 1, current]
    client = ControlClient(head.address)

    async with watching(client, current - 5, heartbeat_seconds=0.1) as events:
        snapshot = await next_event(events)
    assert (snapshot.kind, snapshot.compacted, snapshot.revision) == ("snapshot", True, current)
    assert [(r.server_name, r.status) for r in snapshot.reports] == [(n, "connection_error") for n in names]

    async with watching(client, current - 2, heartbeat_seconds=0.1) as events:
        oldest_kept = await next_event(events)  # just recent enough: the two kept changes replay
    assert (oldest_kept.kind, oldest_kept.compacted, oldest_kept.revision) == ("change", False, current)
    assert len(oldest_kept.reports) == 2


async def test_revision_from_the_future_gets_a_compacted_snapshot(head_factory, http_server):
    head = await head_factory(
        document({"live": server_entry(await http_server()), "closed": server_entry(closed_port())})
    )
    await wait_for_status(head, "live", "success")
    current = head.prober.revision
    client = ControlClient(head.address)
    async with watching(client, current + 1000, heartbeat_seconds=0.1) as events:
        snapshot = await next_event(events)
        heartbeat = await next_event(events, 2.0)
    assert (snapshot.kind, snapshot.compacted, snapshot.revision) == ("snapshot", True, current)
    assert [r.server_name for r in snapshot.reports] == ["live", "closed"]
    assert (heartbeat.kind, heartbeat.revision) == ("heartbeat", current)  # the watcher follows this head now


async def test_reload_removing_a_server_sends_a_fresh_snapshot(head_factory, http_server):
    port = await http_server()
    doc = document({"kept": server_entry(port), "dropped": server_entry(port, "resources_servers")})
    head = await head_factory(doc)
    await wait_for_status(head, "dropped", "success")
    client = ControlClient(head.address)
    async with watching(client, heartbeat_seconds=0.1) as events:
        first = await next_event(events)
        assert head.config_path is not None
        head.config_path.write_text(yaml.safe_dump(document({"kept": server_entry(port)})), encoding="utf-8")
        assert (await client.reload_global_config())[1]
        seen = [first, *await read_until(events, lambda e: e.kind == "snapshot")]
    fresh = seen[-1]
    assert fresh.compacted and [r.server_name for r in fresh.reports] == ["kept"]
    assert_revisions_rise(seen)


async def test_changes_recorded_while_the_snapshot_is_being_sent_still_follow_it(head_factory, http_server):
    """Regression: the stream's position is the snapshot's revision, taken before the snapshot is handed to gRPC,
    not whatever the prober reached by the time the send finished."""
    head = await head_factory(document({"live": server_entry(await http_server())}), probe_interval_seconds=3600.0)
    await head.prober.stop()  # no background rounds: this test decides when the prober records
    await head.prober.start()
    servicer = ControlPlaneServicer(head)
    request = pb.WatchServerStatusesRequest()
    request.heartbeat_interval.CopyFrom(seconds_to_duration(0.05))
    stream = WatchStream(servicer.watch_feed, request)
    snapshot = await stream.next()  # the stream stands after its snapshot, as during a send
    assert snapshot.type == pb.WATCH_EVENT_TYPE_SNAPSHOT
    assert [r.status for r in snapshot.reports] == [pb.SERVER_STATUS_UNSPECIFIED]
    await head.prober.probe_all()  # a change lands before the stream resumes
    change = await asyncio.wait_for(stream.next(), 2.0)
    assert change.type == pb.WATCH_EVENT_TYPE_CHANGE
    assert [(r.server_name, r.status) for r in change.reports] == [("live", pb.SERVER_STATUS_SUCCESS)]
    assert change.revision == head.prober.revision > snapshot.revision
    heartbeat = await asyncio.wait_for(stream.next(), 2.0)
    assert heartbeat.type == pb.WATCH_EVENT_TYPE_HEARTBEAT and heartbeat.revision == change.revision
