"""Several heads serving one deployment (docs/multi-host.md, "Several heads"), on real parts: two `gym-rpc head`
processes, real registering servers (subprocesses registering with both), a real worker (`ServerClient` and its
follower). A registration reaches both heads; a `kill -9` of the head the worker follows costs no call, and its
follower moves to the other head within 2 s (the issue's bound) and takes instances from it; unary control calls
fail over within their deadline; a bad list of addresses is a clear ConfigError.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml

from gym_rpc.client import ServerClient
from gym_rpc.client._follower import follower_for
from gym_rpc.client.control._clients import SyncControlClient
from gym_rpc.client.control._heads import _followed_heads
from gym_rpc.config import GlobalConfig
from gym_rpc.errors import ConfigError, HeadUnreachableError
from gym_rpc.integrations._registration import ServerRegistration
from tests.support import REPO_ROOT
from tests.support.cli import HeadProcess, run_cli, running_head
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.waiting import eventually_blocking

FOLLOWER_MOVES_WITHIN_SECONDS = 2.0  # issue 40: followers move to the other head within 2 s
BOUND_SECONDS = 30.0  # any wait for something that must happen

# A replica of `policy`: answers with its port, registers with every head named (comma-separated), renewing every
# 0.3 s on a 1 s lease.
REPLICA_SCRIPT = """
import sys
from aiohttp import web
from gym_rpc.integrations import register_aiohttp_app

async def answer(request):
    return web.Response(text=sys.argv[2])

app = web.Application()
app.router.add_route("*", "/{tail:.*}", answer)
register_aiohttp_app(
    app, "policy", int(sys.argv[2]), head=sys.argv[1], listen_host="127.0.0.1", refresh_seconds=0.3,
    lease_seconds=1.0,
)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
"""


@contextmanager
def replica(heads: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        [sys.executable, "-c", REPLICA_SCRIPT, heads, str(port)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait(10)


def registered_urls(address: str) -> set[str]:
    """The advertised URLs of `policy`'s registered instances at the head at `address` (none when unreachable)."""
    try:
        rows = SyncControlClient(address, timeout_seconds=5).list_server_instances()
    except HeadUnreachableError:
        return set()
    return {row.advertised_url for row in rows if row.name == "policy" and row.origin == "registered"}


@pytest.fixture
def two_heads(tmp_path: Path) -> Iterator[tuple[HeadProcess, HeadProcess, int]]:
    """Two head processes serving one config whose `policy` is a live aiohttp server in this process's thread
    (its config instance); yields both heads and that server's port."""
    from tests.support.cli import ThreadedHttpServer

    config_server = ThreadedHttpServer()
    config_server.start()
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document({"policy": server_entry(config_server.port)})), encoding="utf-8")
    with ExitStack() as stack:
        first = stack.enter_context(running_head(config))
        second = stack.enter_context(running_head(config))
        yield first, second, config_server.port
    config_server.stop()
    _followed_heads.clear()


@pytest.mark.process
async def test_a_kill_9_of_the_head_followed_fails_no_call_and_the_follower_moves_within_2_s(two_heads) -> None:
    first, second, _ = two_heads
    heads = f"{first.address},{second.address}"
    replica_port, late_port = closed_port(), closed_port()
    with ExitStack() as stack:
        first_replica = stack.enter_context(replica(heads, replica_port))
        url = f"http://{LOOPBACK}:{replica_port}"
        # A registration reaches both heads.
        await asyncio.to_thread(
            eventually_blocking,
            lambda: url in registered_urls(first.address) or first_replica.poll() is not None,
            within=BOUND_SECONDS,
            what="registered at the first",
        )
        assert first_replica.poll() is None, "the replica exited"
        await asyncio.to_thread(
            eventually_blocking,
            lambda: url in registered_urls(second.address),
            within=BOUND_SECONDS,
            what="registered at the 2nd",
        )

        host, port = first.address.rsplit(":", 1)
        head_server = {"host": host, "port": int(port), "addresses": [first.address, second.address]}
        client = await asyncio.to_thread(ServerClient.load_from_global_config, head_server)
        follower = follower_for(heads, client._head.security)
        answered: list[str] = []
        failures: list[BaseException] = []

        async def call() -> None:
            try:
                response = await client.post("policy", "/v1/responses", json={})
                answered.append(await response.text() if response.status == 200 else f"HTTP {response.status}")
            except Exception as error:  # counted: the test fails on any
                failures.append(error)

        deadline = time.monotonic() + BOUND_SECONDS
        while follower.source != first.address or str(replica_port) not in answered:
            assert time.monotonic() < deadline, (follower.source, answered[-5:], failures)
            await call()
        assert follower.source == first.address  # the first in the list, while it answers

        first.process.kill()  # a crash: nothing tells anyone
        killed_at = time.monotonic()
        while follower.source != second.address:
            assert time.monotonic() - killed_at < BOUND_SECONDS, (follower.source, failures)
            await call()
            await asyncio.sleep(0.01)
        moved_after = time.monotonic() - killed_at
        for _ in range(50):
            await call()
        assert failures == []
        assert not any(text.startswith("HTTP") for text in answered), answered
        assert moved_after < FOLLOWER_MOVES_WITHIN_SECONDS, moved_after

        # The worker takes a replica that registers while the first head is dead: it learns it from the second.
        stack.enter_context(replica(heads, late_port))
        deadline = time.monotonic() + BOUND_SECONDS
        while str(late_port) not in answered:
            assert time.monotonic() < deadline, answered[-5:]
            await call()
            await asyncio.sleep(0.01)
        assert failures == []

        # Unary control calls fail over within their deadline; then they go to the head that answered.
        control = SyncControlClient(heads, timeout_seconds=5)
        _followed_heads.clear()  # as a fresh process would: the dead head first
        started = time.monotonic()
        rows = await asyncio.to_thread(control.list_server_instances)
        assert time.monotonic() - started < 5
        assert f"http://{LOOPBACK}:{late_port}" in {row.advertised_url for row in rows}
        assert control.following() == second.address
        await client.aclose()


def test_one_head_has_no_failover_path() -> None:
    """With one head, the client is what it was: no members, every call on the one head's path."""
    client = SyncControlClient(f"{LOOPBACK}:{closed_port()}")
    assert client._members is None and client.addresses == (client.address,)
    with pytest.raises(HeadUnreachableError):
        client.list_server_instances(timeout=2)


@pytest.mark.parametrize(
    ("addresses", "expected"),
    [
        ("127.0.0.1:1,127.0.0.1:1", "'127.0.0.1:1' is listed twice"),
        ("127.0.0.1:1,,127.0.0.1:2", "head address #2 is empty"),
        ("127.0.0.1:1,nohost", "head address #2 'nohost': expected HOST:PORT"),
        ("127.0.0.1:1,127.0.0.1:70000", "head address #2"),
    ],
)
def test_a_bad_list_of_head_addresses_is_a_clear_error(addresses: str, expected: str, monkeypatch) -> None:
    with pytest.raises(ConfigError, match=expected):
        SyncControlClient(addresses)
    with pytest.raises(ConfigError, match=expected):
        ServerRegistration("policy", 8000, head=addresses)
    monkeypatch.setenv("GYM_RPC_HEAD", addresses)
    with pytest.raises(ConfigError, match=expected) as raised:
        ServerClient.load_head_server_config()
    assert "GYM_RPC_HEAD" in str(raised.value)


@pytest.mark.parametrize(
    ("addresses", "expected"),
    [
        (["127.0.0.1:1", "127.0.0.1:1"], "head_server.addresses: .*listed twice"),
        ("127.0.0.1:1,oops", "head_server.addresses: .*#2 'oops': expected HOST:PORT"),
        ({"a": 1}, "head_server.addresses: .*expected a list of HOST:PORT"),
        (["127.0.0.1:1", 7], "head_server.addresses: .*#2 is empty or not a string"),
    ],
)
def test_a_bad_head_server_addresses_fails_the_config_at_load(addresses: object, expected: str) -> None:
    doc = document({"policy": server_entry(8000)})
    doc["head_server"]["addresses"] = addresses
    with pytest.raises(ConfigError, match=expected):
        GlobalConfig.from_document(doc)


def test_head_server_addresses_and_gym_rpc_head_name_every_head(monkeypatch) -> None:
    doc = document({"policy": server_entry(8000)})
    doc["head_server"]["addresses"] = ["127.0.0.1:11000", "[::1]:11001"]
    assert GlobalConfig.from_document(doc).head_settings.addresses == ("127.0.0.1:11000", "[::1]:11001")
    monkeypatch.setenv("GYM_RPC_HEAD", "127.0.0.1:11000, [::1]:11001")
    head = ServerClient.load_head_server_config()
    assert (head.host, head.port) == ("127.0.0.1", 11000)
    assert SyncControlClient(",".join((head.model_extra or {})["addresses"])).addresses == (
        "127.0.0.1:11000",
        "[::1]:11001",
    )
    registration = ServerRegistration("policy", 8000, head="127.0.0.1:11000,[::1]:11001")
    assert registration.head_addresses == ("127.0.0.1:11000", "[::1]:11001")


async def test_an_in_process_head_stopped_moves_a_status_watch_to_the_other(head_factory) -> None:
    """The status watch (not only the follower) reconnects to the other head, from that head's snapshot."""
    from gym_rpc.client.control._clients import ControlClient
    from gym_rpc.client.control._watch import StatusWatch

    doc = document({"policy": server_entry(closed_port())})
    first, second = await head_factory(doc), await head_factory(doc)
    client = ControlClient(f"{first.address},{second.address}")
    watch = StatusWatch(client, heartbeat_seconds=0.5)
    events = watch.events()
    try:
        event = await asyncio.wait_for(anext(events), BOUND_SECONDS)
        assert event.kind == "snapshot" and watch.source == first.address
        # Registrations only the second head has: the watch that moves there has them, from its snapshot.
        only_second = ControlClient(second.address)
        ports = [closed_port() for _ in range(3)]
        for port in ports:
            await only_second.register_server_instance(
                "policy", listen_host=LOOPBACK, listen_port=port, pid=os.getpid(), lease_seconds=60
            )
        await first.stop()
        while watch.source != second.address:
            event = await asyncio.wait_for(anext(events), BOUND_SECONDS)
        assert event.kind == "snapshot"
        listed = {instance.url for instance in watch.reports["policy"].instances}
        assert {f"http://{LOOPBACK}:{port}" for port in ports} <= listed, listed
    finally:
        await events.aclose()
        _followed_heads.clear()


@pytest.mark.process
def test_the_cli_takes_several_heads_and_says_which_list_entry_is_bad(tmp_path: Path) -> None:
    """`gym-rpc status` with the dead head first answers from the live one (exit 0); a bad list is exit 2."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(document({})), encoding="utf-8")
    with running_head(config) as live:
        dead = f"{LOOPBACK}:{closed_port()}"
        result = run_cli(["status", "-o", "json"], env={"GYM_RPC_HEAD": f"{dead},{live.address}"})
        assert result.returncode == 0, result.stderr
    bad = run_cli(["status", "--head", f"{dead},{dead}"])
    assert bad.returncode == 2 and "is listed twice" in bad.stderr, bad.stderr


async def test_a_hung_head_delays_no_registration_at_the_others(head_factory) -> None:
    """A head that accepts the connection and never answers holds its registration call for the whole timeout;
    the live head has the registration before that call gives up (all heads are called at once)."""
    live = await head_factory(document({"policy": server_entry(closed_port())}))
    with socket.socket() as hung:  # listens (the kernel completes the handshake) and never reads a byte
        hung.bind((LOOPBACK, 0))
        hung.listen()
        hung_address = f"{LOOPBACK}:{hung.getsockname()[1]}"
        port = closed_port()
        registration = ServerRegistration(
            "policy", port, listen_host=LOOPBACK, head=f"{hung_address},{live.address}", timeout_seconds=5
        )
        url = f"http://{LOOPBACK}:{port}"
        started = time.monotonic()
        registering = asyncio.create_task(asyncio.to_thread(registration.register))
        while url not in await asyncio.to_thread(registered_urls, live.address):
            assert time.monotonic() - started < BOUND_SECONDS
            await asyncio.sleep(0.05)
        seen_after = time.monotonic() - started
        assert await registering is True  # the live head took it; the hung one timed out
        # Called one after the other, the live head could not have it before the hung head's 5 s timeout.
        assert seen_after < registration.timeout_seconds, seen_after
        assert registration._missed == {hung_address}
        await asyncio.to_thread(registration.deregister)


async def test_the_heads_health_is_down_only_when_no_head_answers(head_factory) -> None:
    """`head_status` turns a failure into a status; with several heads that status comes only once none answers,
    for the blocking and the asyncio client alike (one failover, two drivers)."""
    from gym_rpc.client.control._clients import ControlClient

    live = await head_factory(document({}))
    dead = f"{LOOPBACK}:{closed_port()}"
    try:
        assert await asyncio.to_thread(SyncControlClient(f"{dead},{live.address}").head_status) == "success"
        _followed_heads.clear()  # the asyncio client starts at the dead head too
        assert await ControlClient(f"{dead},{live.address}").head_status() == "success"
        other = f"{LOOPBACK}:{closed_port()}"
        assert await asyncio.to_thread(SyncControlClient(f"{dead},{other}").head_status) == "connection_error"
        assert await ControlClient(f"{dead},{other}").head_status() == "connection_error"
    finally:
        _followed_heads.clear()
