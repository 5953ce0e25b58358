"""The prober cannot be starved (issue 43, point 3), on a real head with real listeners: 150 mute instances (they
accept and never answer) under one server hold at most that server's share of the probes in flight, so a healthy
server listed after it is probed on time and stays up, and a worker calling it is always served; and a probe does
not follow a redirect (an allowed instance answering 302 to another address never makes the head GET that one)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig
from gym_rpc.server.fleet._prober import PROBES_PER_SERVER
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK

MUTE = 150


@contextlib.asynccontextmanager
async def mute_listeners(count: int) -> AsyncIterator[list[int]]:
    """`count` listeners that accept and never answer (each holds its connections until the client goes)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()  # until the prober gives up and closes

    servers = [await asyncio.start_server(hold, LOOPBACK, 0) for _ in range(count)]
    try:
        yield [int(server.sockets[0].getsockname()[1]) for server in servers]
    finally:
        for writer in held:
            writer.close()
        for server in servers:
            server.close()


async def test_mute_instances_of_one_server_do_not_delay_another_servers_probes(
    head_factory: Any, http_server: Any
) -> None:
    healthy = await http_server()
    async with mute_listeners(MUTE) as ports:
        replicas = [f"{LOOPBACK}:{port}" for port in ports[1:]]
        doc = document({"mute": server_entry(ports[0], replicas=replicas), "healthy": server_entry(healthy)})
        head = await head_factory(doc, probe_interval_seconds=0.2, probe_timeout_seconds=1.0)
        control = ControlClient(f"{LOOPBACK}:{head.port}")
        client = await asyncio.to_thread(
            ServerClient.load_from_global_config, BaseServerConfig(host=LOOPBACK, port=head.port)
        )
        for _ in range(100):  # its first probe (the head was just started)
            if head.prober.report("healthy").status is not None:
                break
            await asyncio.sleep(0.05)
        seen, answered = [], 0
        for _ in range(40):  # 4 s: four probe timeouts of the mute instances, twenty probe intervals
            seen.append(head.prober.report("healthy").status)
            report = await control.get_server_status("healthy", timeout=10)
            seen.append(report.status)
            async with await client.post("healthy", "/") as response:
                answered += response.status == 200
            await asyncio.sleep(0.1)
        assert set(seen) == {"success"}, seen
        assert answered == 40
        mute = head.prober.report("mute")
        assert {i.status for i in mute.instances} <= {None, "timeout"}  # probed, a share at a time
        assert sum(i.status == "timeout" for i in mute.instances) >= PROBES_PER_SERVER
    await close_http_sessions()


@pytest.fixture
async def redirecting() -> AsyncIterator[tuple[int, list[str]]]:
    """A server answering 302 to a second one, and the requests that second one received."""
    hits: list[str] = []

    async def forbidden(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"secret": "the metadata service, say"})

    runners = []
    target_app = web.Application()
    target_app.router.add_get("/{tail:.*}", forbidden)
    for app in (target_app,):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, LOOPBACK, 0).start()
        runners.append(runner)
    target = int(runners[0].addresses[0][1])

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://{LOOPBACK}:{target}/latest/meta-data/")

    app = web.Application()
    app.router.add_get("/{tail:.*}", redirect)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    runners.append(runner)
    yield int(runner.addresses[0][1]), hits
    for runner in runners:
        await runner.cleanup()


async def test_a_probe_does_not_follow_a_redirect(head_factory: Any, redirecting: tuple[int, list[str]]) -> None:
    port, hits = redirecting
    head = await head_factory(document({"policy": server_entry(port)}), probe_interval_seconds=0.1)
    control = ControlClient(f"{LOOPBACK}:{head.port}")
    for _ in range(5):
        report = await control.get_server_status("policy", max_age_seconds=0, timeout=10)
        assert (report.status, report.http_status) == ("success", 302), report  # an answer, as NeMo Gym counts
    await asyncio.sleep(0.5)  # background rounds too
    assert hits == []
