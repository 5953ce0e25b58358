"""`gym-rpc relay` as a node runs it: a `gym-rpc head` process, a `gym-rpc relay` process on a unix socket, a
worker (`ServerClient`, told GYM_RPC_WATCH_RELAY) following through it. `kill -9` of the head: the relay keeps
serving and the worker keeps what it knew; the head back: they catch up; `kill -9` of the relay: the worker follows
the head directly. A listen address beyond loopback is a usage error.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gym_rpc.client import ServerClient
from gym_rpc.client._follower import InstanceFollower, follower_for
from gym_rpc.client.control import SyncControlClient
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.wire import WATCH_RELAY_ENV_VAR
from tests.support.cli import LISTENING_PATTERN, STARTUP_SECONDS, run_cli, running_cli, running_head
from tests.support.documents import document, server_entry, write_config
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.waiting import eventually_blocking

WAIT_SECONDS = 30.0  # any wait for something that must happen (a bound, not a measure)


def ports(follower: InstanceFollower) -> set[int]:
    """The ports of `policy`'s instances as the follower knows them."""
    report = follower.reports().get("policy")
    return set() if report is None else {int(i.url.rsplit(":", 1)[1]) for i in report.instances}


def register(head: str, port: int) -> None:
    SyncControlClient(head, timeout_seconds=10).register_server_instance(
        "policy", listen_port=port, listen_host=LOOPBACK, lease_seconds=600
    )


@pytest.mark.process
def test_a_node_follows_through_its_relay_across_a_kill_9_of_the_head_and_without_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = document({"policy": server_entry(closed_port())})
    config = write_config(tmp_path / "config.yaml", doc)
    socket = f"unix:{tmp_path / 'relay.sock'}"
    with running_head(config) as head:
        port = head.address.rsplit(":", 1)[1]
        with running_cli(["relay", "--head", head.address, "--listen", socket]) as relay:
            banner = relay.wait_for_line(LISTENING_PATTERN, STARTUP_SECONDS)
            assert banner.group(1) == socket, banner.string
            assert f"following the head at {head.address}" in banner.string

            monkeypatch.setenv(WATCH_RELAY_ENV_VAR, socket)
            host = BaseServerConfig(host=LOOPBACK, port=int(port))
            client = ServerClient._from_global_config(host, GlobalConfig.from_document(doc))
            client.engine_loads("policy")  # the worker's routes, and its follower, start
            follower = follower_for(client._head.address, client._head.security)
            first, second, third = closed_port(), closed_port(), closed_port()
            register(head.address, first)
            eventually_blocking(lambda: first in ports(follower), within=WAIT_SECONDS, what="through the relay")
            assert follower.via_relay

            head.process.kill()  # -9
            relay.wait_for_stderr(f"cannot follow the head at {head.address}", WAIT_SECONDS)
            assert first in ports(follower)  # fail static: the relay serves what it knew

            # The head back on its port (its registrations kept beside the config): the worker catches up.
            with running_head(config, "--port", port) as again:
                register(again.address, second)
                eventually_blocking(lambda: second in ports(follower), within=WAIT_SECONDS, what="caught up")
                assert first in ports(follower)
                assert follower.via_relay

                relay.process.kill()  # -9: the worker follows the head directly
                register(again.address, third)
                eventually_blocking(lambda: third in ports(follower), within=WAIT_SECONDS, what="the head")
                assert not follower.via_relay


@pytest.mark.process
def test_a_relay_listens_beyond_loopback_only_when_told() -> None:
    result = run_cli(["relay", "--listen", "0.0.0.0:11090"])
    assert result.returncode == 2, result.stderr
    assert re.search(r"gym-rpc relay: error: --listen: .* is not on loopback", result.stderr), result.stderr
