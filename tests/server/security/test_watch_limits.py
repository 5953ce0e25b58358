"""One client cannot take every watch slot of the head (issue 14, item 5): watches are capped per client
address as well as per head, and every loopback address is one client (issue 26: a local process could bind
127.0.0.2, 127.0.0.3, ... for a share each), here 127.0.0.1 and ::1 of a head bound to `localhost`. `gym-rpc status
--watch` refused a slot waits for one."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from gym_rpc.client.control._clients import ControlClient, WatchEvent
from gym_rpc.errors import ControlPlaneError, GymRpcError
from gym_rpc.server._head import HeadServer
from gym_rpc.server.security._watch_slots import WatchSlots, peer_address
from tests.support.cli import STARTUP_SECONDS, running_cli, running_head
from tests.support.documents import document


def watch_stream(client: ControlClient) -> AsyncGenerator[WatchEvent, None]:
    return client.watch_server_statuses(heartbeat_seconds=0.05)


async def dual_stack_head(head_factory: Any) -> HeadServer:
    """A head on `localhost` that got the same port on 127.0.0.1 and ::1: with port 0 gRPC binds ::1 only when
    that port is free there, and another process may hold it; then start another head (at most 5 tries)."""
    doc = document({}, head_server={"host": "localhost", "port": 0})
    for _ in range(5):
        head: HeadServer = await head_factory(doc, max_concurrent_watches=6, max_watches_per_peer=3)
        try:
            await ControlClient(f"[::1]:{head.port}", timeout_seconds=5.0).list_server_statuses()
            return head
        except GymRpcError:
            await head.stop()
    raise AssertionError("no port free on both 127.0.0.1 and ::1 in 5 tries")


async def test_one_client_address_cannot_take_every_watch(head_factory) -> None:
    head = await dual_stack_head(head_factory)
    greedy = ControlClient(f"127.0.0.1:{head.port}", timeout_seconds=5.0)
    held = [watch_stream(greedy) for _ in range(3)]
    try:
        for watch in held:
            assert (await anext(watch)).kind == "snapshot"
        with pytest.raises(ControlPlaneError, match="RESOURCE_EXHAUSTED") as caught:
            await anext(watch_stream(greedy))
        assert "127.0.0.1 (every loopback address counts as one client) already holds 3 status watches" in str(
            caught.value
        )
        # ::1 is the same machine: no second share.
        with pytest.raises(ControlPlaneError, match=r"RESOURCE_EXHAUSTED: ::1 \(every loopback address"):
            await anext(watch_stream(ControlClient(f"[::1]:{head.port}", timeout_seconds=5.0)))
    finally:
        for watch in held:
            await watch.aclose()


def test_another_client_address_gets_its_share_while_one_holds_its_own() -> None:
    slots = WatchSlots("status watches", max_total=6, max_per_peer=3, instead="poll")
    with contextlib.ExitStack() as held:
        for address in ["127.0.0.1", "127.0.0.2", "::1"]:
            assert slots.refusal(address) is None
            held.enter_context(slots.held(address))
        assert "already holds 3" in (slots.refusal("::ffff:127.0.0.9") or "")
        for _ in range(3):
            assert slots.refusal("10.0.0.7") is None
            held.enter_context(slots.held("10.0.0.7"))
        assert "already serves 6" in (slots.refusal("10.0.0.8") or "")
    assert slots.open == 0 and slots.refusal("127.0.0.1") is None


async def test_status_watch_waits_for_a_free_slot_instead_of_giving_up(head_factory) -> None:
    head = await head_factory(document({}), max_concurrent_watches=1, max_watches_per_peer=1)
    held = watch_stream(ControlClient(head.address, timeout_seconds=5.0))
    assert (await anext(held)).kind == "snapshot"
    released = False
    try:
        with running_cli(["status", "--head", head.address, "--watch", "--json"]) as watcher:
            # The head runs in this event loop: the blocking waits on the subprocess go to a thread.
            await asyncio.to_thread(watcher.wait_for_stderr, "RESOURCE_EXHAUSTED", STARTUP_SECONDS)
            await asyncio.to_thread(watcher.wait_for_stderr, "retrying", STARTUP_SECONDS)
            assert watcher.process.poll() is None  # still waiting, not given up
            await held.aclose()
            released = True
            line = json.loads(await asyncio.to_thread(watcher.read_line, STARTUP_SECONDS))
            assert line["kind"] == "snapshot" and line["servers"] == []
            assert await asyncio.to_thread(watcher.interrupt) == 130
            assert "Traceback" not in watcher.stderr_text
    finally:
        if not released:
            await held.aclose()


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:10.0.0.7:53211", "10.0.0.7"),
        ("ipv6:[::1]:53211", "::1"),
        ("ipv6:[fe80::1%25eth0]:8", "fe80::1%eth0"),
        ("ipv6:%5B::1%5D:53211", "::1"),
        ("unix:/tmp/head.sock", "unix:/tmp/head.sock"),
    ],
)
def test_peer_address_drops_the_port(peer: str, address: str) -> None:
    assert peer_address(peer) == address


@pytest.mark.process
async def test_the_cli_sets_the_per_address_cap(tmp_path) -> None:
    """`gym-rpc head --max-watches-per-address N`: the N+1st watch from one address is refused naming N (before
    it, only the Python API could raise or lower that cap)."""
    config = tmp_path / "head.yaml"
    config.write_text("head_server: {host: 127.0.0.1, port: 0}\n", encoding="utf-8")
    with running_head(config, "--max-watches-per-address", "2") as head:
        client = ControlClient(head.address, timeout_seconds=5.0)
        held = [watch_stream(client) for _ in range(2)]
        try:
            for watch in held:
                assert (await anext(watch)).kind == "snapshot"
            with pytest.raises(ControlPlaneError, match="RESOURCE_EXHAUSTED") as caught:
                await anext(watch_stream(client))
            assert "already holds 2 status watches" in str(caught.value)
        finally:
            for watch in held:
                await watch.aclose()
