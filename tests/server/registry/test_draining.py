"""Draining on SIGTERM, against a real head (in-process) and real server processes: a registered aiohttp or
uvicorn server that gets SIGTERM is marked draining (one revision), finishes its call in flight, then deregisters
(one revision) and exits; the drain grace bounds the wait, and a second SIGTERM cuts it short. Renewals report the
calls in flight, which ListServerInstances shows.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.server._head import HeadServer
from gym_rpc.wire import StatusReport
from tests.support.heads import next_report, watching
from tests.support.processes import AIOHTTP_SERVER

UVICORN_SERVER = """
import asyncio, sys
import uvicorn
from gym_rpc.integrations import with_registration

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    seconds = float(dict(p.split("=") for p in scope["query_string"].decode().split("&") if p).get("seconds", 0))
    await asyncio.sleep(seconds)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"done"})

head, port, grace = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
wrapped = with_registration(
    app, "policy", port, head=head, listen_host="127.0.0.1", refresh_seconds=0.3, lease_seconds=3.0,
    drain_grace_seconds=grace,
)
uvicorn.run(wrapped, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=15)
"""


def draining_of(report: StatusReport) -> list[bool]:
    return [i.draining for i in report.instances]


async def in_flight_row(head: HeadServer, port: int, calls: int) -> None:
    """Wait until ListServerInstances shows `calls` in flight on the instance at `port` (renewals report it)."""
    deadline = time.monotonic() + 10
    while True:
        rows = await ControlClient(head.address).list_server_instances()
        (row,) = [r for r in rows if r.instance_id == f"127.0.0.1:{port}"]
        if row.in_flight == calls:
            return
        assert time.monotonic() < deadline, f"never {calls} in flight: {row}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("script", [AIOHTTP_SERVER, UVICORN_SERVER], ids=["aiohttp", "uvicorn"])
async def test_sigterm_drains_finishes_the_call_in_flight_then_deregisters_and_exits(replica, script) -> None:
    head, server = await replica(script, grace=20.0)
    client = ControlClient(head.address)
    call = server.call(seconds=2.0)
    await in_flight_row(head, server.port, 1)
    revision = head.prober.revision
    async with watching(client, revision, heartbeat_seconds=0.2) as events:
        server.process.send_signal(signal.SIGTERM)
        drained_revision, drained = await next_report(events)
        assert draining_of(drained) == [False, True]  # marked first, while its call is still running
        assert not call.done()
        gone_revision, gone = await next_report(events)
        gone_at = time.monotonic()
    status, finished_at = await call
    assert status == 200  # the call in flight finished
    assert finished_at <= gone_at  # and only then did the instance leave
    assert (drained_revision, gone_revision) == (revision + 1, revision + 2)
    assert [i.origin for i in gone.instances] == ["config"]
    assert await asyncio.wait_for(server.process.wait(), 20) in (0, -signal.SIGTERM)


async def test_the_drain_grace_bounds_the_wait_for_calls_in_flight(replica) -> None:
    head, server = await replica(AIOHTTP_SERVER, grace=0.5)
    client = ControlClient(head.address)
    call = server.call(seconds=6.0)
    await in_flight_row(head, server.port, 1)
    async with watching(client, head.prober.revision, heartbeat_seconds=0.2) as events:
        server.process.send_signal(signal.SIGTERM)
        await next_report(events)  # draining
        await next_report(events)  # deregistered after the grace, the call still running
        assert not call.done()
    status, _ = await call  # aiohttp's own shutdown_timeout lets it finish
    assert status == 200
    assert await asyncio.wait_for(server.process.wait(), 20) == 0


async def test_a_second_sigterm_cuts_the_drain_short(replica) -> None:
    head, server = await replica(AIOHTTP_SERVER, grace=20.0)
    client = ControlClient(head.address)
    call = server.call(seconds=6.0)
    await in_flight_row(head, server.port, 1)
    async with watching(client, head.prober.revision, heartbeat_seconds=0.2) as events:
        server.process.send_signal(signal.SIGTERM)
        (_, drained) = await next_report(events)
        assert draining_of(drained) == [False, True]
        server.process.send_signal(signal.SIGTERM)  # hurry: do not wait for the 6 s call
        await next_report(events)
        assert not call.done()
    await call
    assert await asyncio.wait_for(server.process.wait(), 20) == 0
