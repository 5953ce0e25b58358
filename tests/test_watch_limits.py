"""One client cannot take every watch slot of the head (issue 14, item 5): watches are capped per client
address as well as per head. Two peers on loopback: 127.0.0.1 and ::1, both served by a head bound to
`localhost`."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import pytest

from gym_rpc.client._control import ControlClient, WatchEvent
from gym_rpc.errors import ControlPlaneError, GymRpcError
from gym_rpc.server._head import HeadServer
from gym_rpc.server._servicer import peer_address
from tests.conftest import document


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
        assert "127.0.0.1 already holds 3 status watches, the most one client address may" in str(caught.value)
        # Another client address still gets its watch, while the greedy one holds its share.
        other = watch_stream(ControlClient(f"[::1]:{head.port}", timeout_seconds=5.0))
        assert (await anext(other)).kind == "snapshot"
        await other.aclose()
    finally:
        for watch in held:
            await watch.aclose()


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:10.0.0.7:53211", "10.0.0.7"),
        ("ipv6:[::1]:53211", "::1"),
        ("ipv6:[fe80::1%25eth0]:8", "fe80::1%25eth0"),
        ("unix:/tmp/head.sock", "unix:/tmp/head.sock"),
    ],
)
def test_peer_address_drops_the_port(peer: str, address: str) -> None:
    assert peer_address(peer) == address
