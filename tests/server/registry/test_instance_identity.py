"""Instances own their identity (issue 43, point 2): a registration may hold a config instance or static
replica only from that instance's address (or with the head's token), an instance already held only from the
address of the registration holding it, and a deregistration only from there too; everyone else gets
PERMISSION_DENIED and the head logs who tried, a line per interval. What the head reports (status, health,
`gym-rpc status`) agrees with what clients route by.

Telling two machines apart needs two addresses that are not both loopback (every loopback address is this
machine). Tests never listen beyond loopback, so the takeover test runs inside a network namespace of its own
(`unshare -rn`): its servers and head listen on 10.43.0.1, an address of the namespace's own loopback interface,
and the attacker calls the head from 127.0.0.1. Where no such namespace is allowed, that test is skipped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig
from gym_rpc.errors import ControlPlaneError, NoHealthyInstanceError
from tests.support.cli import run_cli
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK
from tests.support.namespaces import add_address, interface_up, needs_namespace, pytest_in_namespace

IN_NAMESPACE = "GYM_RPC_TEST_IN_NETNS"
NODE = "10.43.0.1"  # the namespace's "other machine": an address of its loopback interface
ATTACKER_PID = 999


@needs_namespace
def test_an_instance_is_held_only_from_its_own_address() -> None:
    """Runs the attack below inside a network namespace of its own."""
    pytest_in_namespace(f"{__file__}::test_a_takeover_from_another_address_is_refused_and_logged", IN_NAMESPACE)


async def _answer(request: web.Request) -> web.Response:
    assert request.transport is not None
    return web.json_response({"port": request.transport.get_extra_info("sockname")[1]})


@pytest.fixture
async def node_servers() -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """Real aiohttp servers on NODE (inside the namespace)."""
    runners: list[web.AppRunner] = []

    async def start() -> int:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", _answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, NODE, 0).start()
        runners.append(runner)
        return int(runner.addresses[0][1])

    yield start
    for runner in runners:
        await runner.cleanup()


async def _refused(call: Awaitable[Any]) -> str:
    with pytest.raises(ControlPlaneError) as caught:
        await call
    assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED, caught.value
    return str(caught.value)


@pytest.mark.skipif(os.environ.get(IN_NAMESPACE) != "1", reason="runs inside a network namespace of its own")
async def test_a_takeover_from_another_address_is_refused_and_logged(
    node_servers: Callable[[], Awaitable[int]], head_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    interface_up(b"lo")
    add_address(b"lo:1", NODE)
    interface_up(b"lo:1")
    own, replica, unheld = [await node_servers() for _ in range(3)]
    doc = document({"policy": server_entry(own, host=NODE, replicas=[f"{NODE}:{replica}", f"{NODE}:{unheld}"])})
    head = await head_factory(doc, host="0.0.0.0", open_registrations=True)
    owner = ControlClient(f"{NODE}:{head.port}")  # the servers' machine
    attacker = ControlClient(f"{LOOPBACK}:{head.port}")  # another machine, as far as the head can tell
    for pid, port in ((101, own), (102, replica)):
        await owner.register_server_instance("policy", listen_port=port, listen_host=NODE, pid=pid)

    caplog.set_level(logging.WARNING, logger="gym_rpc.server._servicer")
    started = time.monotonic()
    for _ in range(30):  # a replacement that drains the held replica, from another pid at its address
        message = await _refused(
            attacker.register_server_instance(
                "policy", listen_port=replica, listen_host=NODE, pid=ATTACKER_PID, draining=True
            )
        )
    assert "held by the registration of pid 102 from 10.43.0.1" in message and "from 127.0.0.1" in message
    # The holder's own pid is no key (ListServerInstances shows it): not to renew as draining, nor to deregister.
    await _refused(
        attacker.register_server_instance("policy", listen_port=own, listen_host=NODE, pid=101, draining=True)
    )
    await _refused(attacker.deregister_server_instance("policy", pid=102))
    # An instance the config names and nobody holds is no one's to take either.
    message = await _refused(
        attacker.register_server_instance("policy", listen_port=unheld, listen_host=NODE, pid=7)
    )
    assert "static replica" in message and f"({NODE})" in message
    refusals = [r for r in caplog.records if "refused the" in r.getMessage()]
    windows = 1 + int((time.monotonic() - started) // 10)  # 1 unless the machine is very loaded
    assert 1 <= len(refusals) <= windows + 1, [r.getMessage() for r in refusals]  # who tried, a line per 10 s
    assert "from 127.0.0.1" in refusals[0].getMessage() and not any(r.exc_info for r in refusals)

    report = head.prober.report("policy")
    assert report.status == "success" and not any(i.draining for i in report.instances)
    assert {i.pid for i in report.instances} == {101, 102, 0}
    client = await asyncio.to_thread(
        ServerClient.load_from_global_config, BaseServerConfig(host=NODE, port=head.port)
    )
    answered = []
    for _ in range(30):
        async with await client.post("policy", "/v1/responses", json={}) as response:
            answered.append((await response.json())["port"])
    assert set(answered) <= {own, replica, unheld} and len(set(answered)) >= 2  # every call served
    await close_http_sessions()

    # The holder itself still drains and deregisters its instance; and the unheld one is its server's to take.
    await owner.register_server_instance("policy", listen_port=replica, listen_host=NODE, pid=102, draining=True)
    assert await owner.deregister_server_instance("policy", pid=102) is True
    await owner.register_server_instance("policy", listen_port=unheld, listen_host=NODE, pid=103)


async def test_the_heads_status_agrees_with_what_clients_route_by(
    head_factory: Any, http_server: Callable[[], Awaitable[int]], tmp_path: Path
) -> None:
    """Two instances that answer, both draining (or both deregistered): no client sends them work, so the status
    is not SUCCESS, health says NOT_SERVING and `gym-rpc status` exits 1."""
    first, second = await http_server(), await http_server()
    head = await head_factory(document({"policy": server_entry(first, replicas=[f"{LOOPBACK}:{second}"])}))
    control = ControlClient(f"{LOOPBACK}:{head.port}")
    client = await asyncio.to_thread(
        ServerClient.load_from_global_config, BaseServerConfig(host=LOOPBACK, port=head.port)
    )

    async def agreed(draining: bool, up: bool) -> None:
        for _ in range(200):
            report = head.prober.report("policy")
            if (report.status == "success") == up and all(i.status == "success" for i in report.instances):
                break
            await asyncio.sleep(0.05)
        assert (report.status == "success") is up, report
        if not up:
            assert ("draining" if draining else "deregistered") in report.detail
        status = await asyncio.to_thread(run_cli, ["status", "--head", f"{LOOPBACK}:{head.port}"])
        assert status.returncode == (0 if up else 1), status.stdout
        for _ in range(200):  # the client follows the head's watch
            try:
                async with await client.post("policy", "/") as response:
                    await response.read()
                served = True
            except NoHealthyInstanceError:
                served = False
            if served is up:
                break
            await asyncio.sleep(0.05)
        assert served is up

    await agreed(draining=False, up=True)
    for pid, port in ((1, first), (2, second)):
        await control.register_server_instance(
            "policy", listen_port=port, listen_host=LOOPBACK, pid=pid, draining=True
        )
    await agreed(draining=True, up=False)
    for pid in (1, 2):
        assert await control.deregister_server_instance("policy", pid=pid) is True
    await agreed(draining=False, up=False)
    await close_http_sessions()
