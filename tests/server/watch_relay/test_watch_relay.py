"""A node's watch relay (gym_rpc.server.watch_relay) on real parts: a real head, a real relay on a unix socket, a
real worker (`ServerClient` and its follower, told GYM_RPC_WATCH_RELAY). The worker sees registrations and label
changes through the relay while the head holds one watch (the relay's); the head stopped, the relay serves what it
knew and the worker keeps it; the head back, both catch up; the relay stopped, the worker follows the head directly
and says so once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest

from gym_rpc.client import ServerClient
from gym_rpc.client._follower import InstanceFollower, follower_for
from gym_rpc.client.control import ControlClient, StatusWatch
from gym_rpc.config import BaseServerConfig
from gym_rpc.errors import ControlPlaneError, GymRpcError
from gym_rpc.server import HeadServer
from gym_rpc.server.watch_relay import WatchRelay, checked_listen_address
from gym_rpc.wire import WATCH_RELAY_ENV_VAR
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.waiting import eventually

WAIT_SECONDS = 30.0  # any wait for something that must happen (a bound, not a measure)


def instances(follower: InstanceFollower) -> dict[str, dict[str, str]]:
    """`policy`'s instances as the follower knows them: URL -> labels."""
    report = follower.reports().get("policy")
    return {} if report is None else {i.url: dict(i.labels) for i in report.instances}


async def register(head: HeadServer, port: int, **labels: str) -> str:
    url = await ControlClient(head.address, timeout_seconds=10).register_server_instance(
        "policy", listen_port=port, listen_host=LOOPBACK, lease_seconds=600, labels=labels
    )
    return str(url)


async def test_workers_follow_through_the_relay_keep_its_state_while_the_head_is_down_and_fall_back_without_it(
    head_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config_port = closed_port()
    doc = document({"policy": server_entry(config_port)})
    head = await head_factory(doc)
    relay = WatchRelay(head.address, f"unix:{tmp_path / 'relay.sock'}", push_quiet_seconds=0.01)
    await relay.start()
    try:
        monkeypatch.setenv(WATCH_RELAY_ENV_VAR, str(relay.address))
        client = ServerClient._from_global_config(BaseServerConfig(host=LOOPBACK, port=head.port), head.config)
        client.engine_loads("policy")  # the worker's routes, and its follower, start
        follower = follower_for(client._head.address, client._head.security)
        first = await register(head, closed_port(), zone="a")
        await eventually(
            lambda: instances(follower).get(first) == {"zone": "a"}, within=WAIT_SECONDS, what="registered"
        )
        assert follower.via_relay
        assert (head.observed_watchers, relay.watches) == (
            1,
            1,
        )  # the head holds the relay's watch, not the worker's

        await register(head, int(first.rsplit(":", 1)[1]), zone="b")  # a label change
        await eventually(
            lambda: instances(follower).get(first) == {"zone": "b"}, within=WAIT_SECONDS, what="relabelled"
        )

        # The head goes away: the relay keeps serving what it knew, to the worker and to a watch opened now.
        port = head.port
        known = instances(follower)
        await head.stop()
        await eventually(lambda: relay._head_down, within=WAIT_SECONDS, what="the relay noticed")
        fresh = StatusWatch(ControlClient(str(relay.address), timeout_seconds=10))
        async for event in fresh:
            assert event.kind == "snapshot"
            listed = {i.url for r in event.reports if r.server_name == "policy" for i in r.instances}
            break
        assert first in listed
        assert instances(follower) == known

        # The head back on its port (without its registrations: a fresh one): the relay and the worker catch up.
        head = await head_factory(doc, port=port)
        second = await register(head, closed_port(), zone="c")
        await eventually(lambda: second in instances(follower), within=WAIT_SECONDS, what="caught up")
        assert follower.via_relay

        # The relay goes away: the worker follows the head directly, and says so once.
        with caplog.at_level(logging.WARNING, logger="gym_rpc.client.replicas"):
            await relay.stop()
            third = await register(head, closed_port(), zone="d")
            await eventually(lambda: third in instances(follower), within=WAIT_SECONDS, what="followed the head")
            assert not follower.via_relay
        said = [r.getMessage() for r in caplog.records if "through the watch relay" in r.getMessage()]
        assert len(said) == 1, said
        assert str(relay.address) in said[0]
    finally:
        await relay.stop()


async def test_a_relay_that_has_not_reached_the_head_sends_its_workers_to_the_head(
    head_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = await head_factory(document({"policy": server_entry(closed_port())}))
    relay = WatchRelay(f"{LOOPBACK}:{closed_port()}", f"unix:{tmp_path / 'relay.sock'}")  # no head there
    await relay.start()
    try:
        monkeypatch.setenv(WATCH_RELAY_ENV_VAR, str(relay.address))
        client = ServerClient._from_global_config(BaseServerConfig(host=LOOPBACK, port=head.port), head.config)
        client.engine_loads("policy")
        follower = follower_for(client._head.address, client._head.security)
        url = await register(head, closed_port())
        # An empty list from the relay would have been worse than none: the worker follows the head instead.
        await eventually(lambda: url in instances(follower), within=WAIT_SECONDS, what="followed the head")
        assert not follower.via_relay
        assert relay.watches == 0
    finally:
        await relay.stop()


def test_the_relay_listens_on_loopback_or_a_unix_socket_only_unless_told() -> None:
    assert checked_listen_address("unix:/run/gym-rpc/relay.sock") == "unix:/run/gym-rpc/relay.sock"
    assert checked_listen_address("127.0.0.1:0") == "127.0.0.1:0"
    assert checked_listen_address("[::1]:11090") == "[::1]:11090"
    with pytest.raises(GymRpcError, match="not on loopback"):
        checked_listen_address("0.0.0.0:11090")
    assert checked_listen_address("0.0.0.0:11090", allow_remote=True) == "0.0.0.0:11090"
    with pytest.raises(GymRpcError, match="needs a path"):
        checked_listen_address("unix:")


async def test_the_configs_head_server_watch_relay_sends_workers_through_the_relay(
    head_factory, tmp_path: Path
) -> None:
    socket = f"unix:{tmp_path / 'relay.sock'}"
    doc = document({"policy": server_entry(closed_port())})
    doc["head_server"]["watch_relay"] = socket  # every node's relay at the same path: one line of the config
    head = await head_factory(doc)
    relay = WatchRelay(head.address, socket)
    await relay.start()
    try:
        client = ServerClient._from_global_config(BaseServerConfig(host=LOOPBACK, port=head.port), head.config)
        client.engine_loads("policy")
        follower = follower_for(client._head.address, client._head.security, socket)
        url = await register(head, closed_port())
        await eventually(lambda: url in instances(follower), within=WAIT_SECONDS, what="through the relay")
        assert follower.via_relay and relay.watches == 1
    finally:
        await relay.stop()


async def test_a_relay_serves_at_most_max_watches_and_frees_a_slot_when_one_closes(
    head_factory, tmp_path: Path
) -> None:
    head = await head_factory(document({"policy": server_entry(closed_port())}))
    relay = WatchRelay(head.address, f"unix:{tmp_path / 'relay.sock'}", max_watches=1)
    await relay.start()
    try:
        await eventually(lambda: relay.mirror.synced, within=WAIT_SECONDS, what="the relay reached the head")
        local = ControlClient(str(relay.address), timeout_seconds=10)
        held = local.watch_server_statuses()
        assert (await anext(held)).kind == "snapshot"
        with pytest.raises(ControlPlaneError) as caught:
            await anext(local.watch_server_statuses())
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already serves 1 relayed watches; retry later or follow the head directly" in str(caught.value)
        await held.aclose()
        await eventually(lambda: relay.watches == 0, within=WAIT_SECONDS, what="the slot freed")
        again = local.watch_server_statuses()
        assert (await anext(again)).kind == "snapshot"
        await again.aclose()
    finally:
        await relay.stop()
