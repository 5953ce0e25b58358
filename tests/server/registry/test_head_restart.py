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
from typing import Any

import pytest
import yaml
from aiohttp import web

from gym_rpc.client import ServerClient, SyncControlClient, _relearn_grace
from gym_rpc.client._follower import _followers, close_instance_followers
from gym_rpc.client.server_client import rollout_context
from gym_rpc.config import BaseServerConfig
from gym_rpc.integrations import ServerRegistration, register_aiohttp_app
from gym_rpc.server.registry import registrations_file
from tests.support.cli import run_cli, running_head
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK

pytestmark = pytest.mark.process

NAME = "sessions"
REPLICAS = 3
ROLLOUTS = 40
REGISTRATION = web.AppKey("registration", ServerRegistration)


async def _replica(
    port_holder: list[int], head: str | None, refresh: float = 60.0, silent_head: str | None = None
) -> web.AppRunner:
    """An aiohttp server answering its own port, registered as an instance of NAME (renewed every `refresh` s: no
    renewal comes during the restarts below), or not registered (`head` None: the config's own instance), or, with
    `silent_head`, registered there once and never again (no renewal, no following of the head)."""
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    port = int(listener.getsockname()[1])

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"port": port})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    if head is not None:
        app[REGISTRATION] = register_aiohttp_app(
            app, NAME, port, head=head, listen_host=LOOPBACK, refresh_seconds=refresh, lease_seconds=3 * refresh
        )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()  # registers (the helper's cleanup_ctx entry)
    await web.SockSite(runner, listener).start()
    if silent_head is not None:
        once = ServerRegistration(
            NAME, port, head=silent_head, listen_host=LOOPBACK, refresh_seconds=None, lease_seconds=7200.0
        )
        assert await asyncio.to_thread(once.register)
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

    async def start(head: str | None, count: int, **options: Any) -> list[int]:
        ports: list[int] = []
        for _ in range(count):
            runner = await _replica(ports, head, **options)
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


def _registered_ports(address: str) -> set[int]:
    """The ports of NAME's registered instances the head at `address` lists."""
    rows = SyncControlClient(address, timeout_seconds=10).list_server_instances()
    return {
        int(row.url.rsplit(":", 1)[1].strip("/"))
        for row in rows
        if row.name == NAME and row.origin == "registered"
    }


@pytest.mark.timeout(240)
async def test_a_head_restarted_without_its_file_moves_no_rollout_and_its_servers_register_again_at_once(
    tmp_path: Path, replicas_of, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head that comes back without its registrations (its file gone: a bridge, a config given in code) knows
    only its config. The registering servers that follow it register again as soon as it answers (their renewals
    are an hour away), and the worker keeps what the fresh head has not relearned meanwhile, here a server that
    registered once and never again: 0 failed calls, 0 rollouts moved. Before: the worker dropped the registered
    instances at the fresh head's first snapshot (their rollouts moved), and the head learned of them only at
    their next renewal."""
    monkeypatch.setattr(_relearn_grace, "DEFAULT_GRACE_SECONDS", 3600.0)  # no grace runs out during the test
    [own] = await replicas_of(None, 1)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document({NAME: server_entry(own, "resources_servers")})), encoding="utf-8")
    with running_head(config) as first:
        address = first.address
        following = await replicas_of(address, REPLICAS, refresh=3600.0)
        [silent] = await replicas_of(None, 1, silent_head=address)
        host, port = address.rsplit(":", 1)
        client = ServerClient.load_from_global_config(BaseServerConfig(host=host, port=int(port)))
        where: dict[str, set[int]] = {}
        failures: list[str] = []
        try:
            deadline = time.monotonic() + 60
            while len({p for ports in where.values() for p in ports}) < REPLICAS + 2:  # every instance followed
                assert time.monotonic() < deadline, where
                await _calls(client, 1, where, failures)
            assert failures == []
            assert any(silent in ports for ports in where.values()), where  # rollouts on the silent server
            where = {}

            [follower] = [f for f in _followers.values() if f.address == address]
            before = follower.revision
            first.process.kill()  # a crash: no deregistration
            await asyncio.to_thread(first.process.wait, 10)
            registrations_file.beside(config).unlink(missing_ok=True)  # and it comes back without its file
            await _calls(client, 2, where, failures)  # the head is down: calls go to the instances known
            with running_head(config, "--port", port) as second:
                assert second.address == address
                restarted = time.monotonic()
                while follower.revision == before:  # the worker has the new head's first snapshot
                    assert time.monotonic() < restarted + 60, "the worker never followed the new head"
                    await _calls(client, 1, where, failures)
                # The servers that follow the head are back in it long before their renewal (an hour away).
                while (relearned := await asyncio.to_thread(_registered_ports, address)) != set(following):
                    assert time.monotonic() < restarted + 90, f"the new head lists {relearned}, not {following}"
                    await _calls(client, 1, where, failures)
                await _calls(client, 3, where, failures)
                assert silent not in await asyncio.to_thread(_registered_ports, address)  # never relearned: kept
        finally:
            close_instance_followers()
            await client.aclose()

    assert failures == []
    moved = {rollout: sorted(ports) for rollout, ports in where.items() if len(ports) > 1}
    assert moved == {}, moved
    assert any(silent in ports for ports in where.values()), where  # the kept server still served its rollouts


async def test_status_reports_a_warming_head_as_warming_then_waits_for_its_first_probes(head_factory, http_server):
    """A head that has not probed a server yet (it just started: here its first probe is held until the first
    status has run) has it pending: `gym-rpc status` says the head is warming, not that the server is down, and
    given time waits for the probe. (A probe held a fixed 5 s was answered before a loaded machine's CLI
    started.)"""
    quick_done = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await quick_done.wait()
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/", slow)
    head = await head_factory(
        document({NAME: server_entry(await http_server(app), "resources_servers")}),
        probe_interval_seconds=3600.0,
        probe_timeout_seconds=3600.0,
    )
    try:
        quick = await asyncio.to_thread(run_cli, ["status", "--head", head.address, "--timeout", "1"], timeout=60)
    finally:
        quick_done.set()
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
