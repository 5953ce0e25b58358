"""A head restart is invisible to workers (issue 40, points 1 and 2): a head killed -9 and started again takes back
the registrations it had (an atomic file beside its config), so workers following it keep every live instance:
no call fails and no rollout moves off the instance it was on. Everything is real: the head is a `gym-rpc head`
process, the replicas are aiohttp servers registering with the real helper, the worker a ServerClient following
the head's watch."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from gym_rpc.client import ServerClient
from gym_rpc.client._follower import _followers, close_instance_followers
from gym_rpc.client.server_client import rollout_context
from gym_rpc.config import BaseServerConfig
from gym_rpc.integrations import register_aiohttp_app
from gym_rpc.server import _registrations_file as registrations_file
from tests.cli_helpers import run_cli, running_head
from tests.conftest import LOOPBACK, document, server_entry

pytestmark = pytest.mark.process

NAME = "sessions"
REPLICAS = 3
ROLLOUTS = 40


async def _replica(port_holder: list[int], head: str | None) -> web.AppRunner:
    """An aiohttp server answering its own port, registered as an instance of NAME (renewed every 60 s: no renewal
    comes during the restart below, so only what the head kept can bring the replicas back), or not registered
    (`head` None: the config's own instance)."""
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    port = int(listener.getsockname()[1])

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"port": port})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    if head is not None:
        register_aiohttp_app(
            app, NAME, port, head=head, listen_host=LOOPBACK, refresh_seconds=60.0, lease_seconds=180.0
        )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()  # registers (the helper's cleanup_ctx entry)
    await web.SockSite(runner, listener).start()
    port_holder.append(port)
    return runner


def _kept(path: Path) -> list[object]:
    """The registrations in the head's file (none before it is written)."""
    return json.loads(path.read_text(encoding="utf-8"))["registrations"] if path.exists() else []


async def _calls(client: ServerClient, rounds: int, where: dict[str, set[int]], failures: list[str]) -> None:
    for _ in range(rounds):
        for index in range(ROLLOUTS):
            rollout = f"rollout-{index}"
            try:
                with rollout_context(rollout):
                    response = await client.post(NAME, "/seed_session", json={})
                    where.setdefault(rollout, set()).add((await response.json())["port"])
            except Exception as error:  # every failure is counted, whatever it is
                failures.append(f"{type(error).__name__}: {error}")


@pytest.fixture
async def replicas_of() -> AsyncIterator[list]:
    runners: list[web.AppRunner] = []
    apps: list[web.Application] = []

    async def start(head: str | None, count: int) -> list[int]:
        ports: list[int] = []
        for _ in range(count):
            runner = await _replica(ports, head)
            runners.append(runner)
            apps.append(runner.app)
        return ports

    yield start  # type: ignore[misc]
    for runner in runners:
        await runner.cleanup()


async def test_a_head_killed_9_and_restarted_moves_no_rollout_and_fails_no_call(
    tmp_path: Path, replicas_of
) -> None:
    [own] = await replicas_of(None, 1)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document({NAME: server_entry(own, "resources_servers")})), encoding="utf-8")
    with running_head(config) as first:
        address = first.address
        await replicas_of(address, REPLICAS)
        host, port = address.rsplit(":", 1)
        client = ServerClient.load_from_global_config(BaseServerConfig(host=host, port=int(port)))
        where: dict[str, set[int]] = {}
        failures: list[str] = []
        try:
            deadline = time.monotonic() + 30
            while len({p for ports in where.values() for p in ports}) < REPLICAS + 1:  # every instance followed
                assert time.monotonic() < deadline, where
                await _calls(client, 1, where, failures)
            assert failures == []
            where = {}
            # The head writes its file at most every 0.2 s after a change: wait for the last registration in it.
            kept = registrations_file.beside(config)
            while (
                not kept.exists() or len(json.loads(kept.read_text(encoding="utf-8"))["registrations"]) < REPLICAS
            ):
                assert time.monotonic() < deadline, (_kept(kept), first.stderr_text[-3000:])
                await asyncio.sleep(0.05)

            [follower] = [f for f in _followers.values() if f.address == address]
            before = follower.revision
            first.process.kill()  # a crash: no deregistration, nothing written
            await asyncio.to_thread(first.process.wait, 10)
            await _calls(client, 2, where, failures)  # the head is down: calls go to the instances known
            with running_head(config, "--port", port) as second:
                assert second.address == address
                # The worker follows the new head (its first snapshot: a revision of its own), and calls on.
                while follower.revision == before:
                    assert time.monotonic() < deadline + 60, "the worker never followed the new head"
                    await _calls(client, 1, where, failures)
                await _calls(client, 3, where, failures)
                status = await asyncio.to_thread(run_cli, ["status", "--head", address, "--output", "json"])
        finally:
            close_instance_followers()
            await client.aclose()

    assert failures == []
    moved = {rollout: sorted(ports) for rollout, ports in where.items() if len(ports) > 1}
    assert moved == {}, moved
    assert status.returncode == 0, (status.stdout, status.stderr)
    assert {row["status"] for row in json.loads(status.stdout)} == {"success"}


async def test_status_reports_a_warming_head_as_warming_then_waits_for_its_first_probes(head_factory, http_server):
    """A head that has not probed a server yet (it just started: here its first probe is held 5 s) has it pending:
    `gym-rpc status` says the head is warming, not that the server is down, and given time waits for the probe."""

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5.0)
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/", slow)
    head = await head_factory(
        document({NAME: server_entry(await http_server(app), "resources_servers")}),
        probe_interval_seconds=3600.0,
        probe_timeout_seconds=30.0,
    )
    quick = await asyncio.to_thread(run_cli, ["status", "--head", head.address, "--timeout", "1"])
    assert quick.returncode == 1, quick.stdout
    assert f"warming, not probed yet: {NAME}" in quick.stdout and "down:" not in quick.stdout, quick.stdout

    patient = await asyncio.to_thread(run_cli, ["status", "--head", head.address, "--timeout", "20"], timeout=40)
    assert patient.returncode == 0, patient.stdout
    assert "1/1 up" in patient.stdout


async def test_a_registrations_file_the_head_cannot_read_starts_it_without_them(head_factory, tmp_path, caplog):
    """A kept file that is not one (truncated by hand, another tool's) costs a WARNING line, not the head: it
    starts with no registrations."""
    (tmp_path / "config0.yaml.registrations.json").write_text('{"format": "something else"', encoding="utf-8")
    head = await head_factory(document({NAME: server_entry(1, "resources_servers")}))
    assert len(head.registry) == 0
    assert "holds no registrations this head can read" in caplog.text
    assert head.registrations_path == tmp_path / "config0.yaml.registrations.json"
