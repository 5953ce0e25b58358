"""The resend budget is per server name (issue 43, point 5), on real aiohttp servers and refused ports: a storm
of calls against one refusing server does not delay another server's calls through a blip of its own, and a
failover to an instance the call has not tried goes out at once, taking no slot, even when every slot of its
server's is held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from omegaconf import OmegaConf

from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.resend._budget import RESEND_BUDGET
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.waiting import eventually


async def answering(port: int) -> web.AppRunner:
    """An aiohttp server answering 200 to everything at `port` (which a test may hold closed before)."""

    async def ok(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"port": port})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", ok)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, port, reuse_address=True).start()
    return runner


def client_of(servers: dict[str, Any], **retry: Any) -> ServerClient:
    """A client of `servers` with `retry` as its http_client.retry, following no head (the config's instances)."""
    client = ServerClient(
        head_server_config=BaseServerConfig(host=LOOPBACK, port=closed_port()),
        global_config_dict=OmegaConf.create(document(servers, http_client={"retry": retry})),
    )
    client.follow_instances(False)
    return client


@pytest.fixture
async def closing() -> AsyncIterator[None]:
    yield
    await close_http_sessions()
    assert (RESEND_BUDGET.held, RESEND_BUDGET.waiting, RESEND_BUDGET.resending) == (0, 0, 0)


async def a_blip(client: ServerClient, port: int, calls: int) -> tuple[float, list[Any]]:
    """`calls` calls to `blip`, whose port refuses for 1.5 s and then answers: the seconds until the last of them
    ended, and what each returned (a status) or raised."""

    async def one() -> Any:
        async with await client.post("blip", "/v1/responses", json={}) as response:
            await response.read()
            return response.status

    started = time.monotonic()
    tasks = [asyncio.create_task(one()) for _ in range(calls)]
    await asyncio.sleep(1.5)
    runner = await answering(port)
    try:
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        return time.monotonic() - started, outcomes
    finally:
        await runner.cleanup()


async def test_a_storm_against_one_refusing_server_does_not_delay_another_servers_blip(closing) -> None:
    """The issue's run: 300 calls resending against a server that refuses (its slots full, its queue hundreds
    long), while another server refuses for 1.5 s under 40 calls. Before, the second server's resends queued
    behind the storm's in the one queue of the process: 11.9 s, 15 of 40 calls failed (`client budget`). Now its
    calls end as soon as they would without the storm (the same blip alone, in the same run, is the yardstick)."""
    blip_port = closed_port()
    client = client_of(
        {"storm": server_entry(closed_port()), "blip": server_entry(blip_port)},
        refused={"attempts": 1000, "seconds": 20.0},
    )
    alone, alone_outcomes = await a_blip(client, blip_port, 40)
    storm = [asyncio.create_task(client.post("storm", "/v1/responses", json={})) for _ in range(300)]
    try:
        await eventually(
            lambda: RESEND_BUDGET.waiting > 200, within=30.0, every=0.01
        )  # refused, their resends holding its slots and queued
        stormy, stormy_outcomes = await a_blip(client, blip_port, 40)
        assert all(not task.done() for task in storm)  # the storm went on all along
    finally:
        for task in storm:
            task.cancel()
        await asyncio.gather(*storm, return_exceptions=True)
    assert alone_outcomes == [200] * 40
    assert stormy_outcomes == [200] * 40
    assert stormy < 1.5 * alone + 1.0, (stormy, alone)


async def dropping_server() -> asyncio.Server:
    """Reads each request, then closes the connection without an answer (a drop after the request was written)."""

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.close()

    return await asyncio.start_server(drop, LOOPBACK, 0)


async def test_a_failover_to_an_untried_instance_never_waits_for_a_slot(closing) -> None:
    """Every slot of `policy`'s is held, and its queue long, by calls of another client of the process resending
    to a `policy` that drops them, each pausing 1 s: a call whose first attempt is refused still fails over to
    the healthy instance at once. Before, the failover waited for a slot like any resend, behind them, and failed
    with `client budget` when its refused budget (1 s) ran out."""
    healthy_port = closed_port()
    runner = await answering(healthy_port)
    dropper = await dropping_server()
    budget = {"share": 0.01, "floor": 1}
    holders_client = client_of(
        {"policy": server_entry(dropper.sockets[0].getsockname()[1])},
        initial_backoff_seconds=1.0,
        max_backoff_seconds=1.0,
        dropped_after_write={"attempts": 1000, "seconds": 30.0},
        client_budget=budget,
    )
    client = client_of(
        {"policy": server_entry(closed_port(), replicas=[f"{LOOPBACK}:{healthy_port}"])},
        refused={"attempts": 1000, "seconds": 1.0},
        client_budget=budget,
    )
    holders = [asyncio.create_task(holders_client.post("policy", "/v1/responses", json={})) for _ in range(10)]
    try:
        await eventually(lambda: RESEND_BUDGET.held == 1 and RESEND_BUDGET.waiting >= 5, within=30.0, every=0.01)
        statuses = []
        for _ in range(20):
            async with await client.post("policy", "/v1/responses", json={}) as response:
                statuses.append(response.status)
        assert client._routing is not None
        dead = client._routing.routes["policy"].instances[0]
        assert dead.picks >= 1  # at least one call went there first and failed over
        assert statuses == [200] * 20
    finally:
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        dropper.close()
        await runner.cleanup()
