"""Faults with real processes: a head killed with SIGKILL and restarted on its port, a head that is not there, a
data-plane server killed in the middle of a request, and clients that ask for more than their share."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import grpc
import pytest
import yaml
from omegaconf import OmegaConf

from gym_rpc.client.control._clients import ControlClient, SyncControlClient, WatchEvent
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.errors import (
    ControlPlaneError,
    GymRpcError,
    HeadTimeoutError,
    HeadUnreachableError,
    ServerUnreachableError,
)
from gym_rpc.server._head import HeadOptions, HeadServer
from gym_rpc.v1 import control_plane_pb2 as pb
from gym_rpc.wire import MAX_REQUEST_BYTES, SERVICE_NAME
from tests.support.cli import STARTUP_SECONDS, running_cli, running_head, threaded_http_server
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.waiting import eventually_blocking

T = TypeVar("T")
RECOVERY_SECONDS = 15.0


# --- the head killed and restarted ---


def test_restarted_head_is_picked_up_without_restarting_clients(tmp_path: Path) -> None:
    with threaded_http_server(200) as live:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(document({"live": server_entry(live.port)})), encoding="utf-8")
        port = closed_port()  # held for the whole test: nothing else can take it while the head is down
        with running_head(path, "--port", str(port)) as first:
            address = first.address
            control = SyncControlClient(address, timeout_seconds=2.0)
            client = ServerClient.load_from_global_config(BaseServerConfig(host=LOOPBACK, port=port))
            eventually_blocking(
                lambda: client.poll_for_status("live"),
                lambda status: status == "success",
                within=RECOVERY_SECONDS,
                every=0.1,
                ignoring=(ControlPlaneError, OSError),
            )
            with running_cli(["status", "--watch", "--json", "--head", address]) as watch:
                assert json.loads(watch.read_line(STARTUP_SECONDS))["kind"] == "snapshot"

                first.process.kill()  # SIGKILL: no goodbye, no graceful shutdown
                first.process.wait(timeout=10)
                with pytest.raises(HeadUnreachableError, match=re.escape(address)):
                    control.list_server_statuses()
                # The head is down, the server is not: probed directly, as NeMo Gym does (issue 12).
                assert client.poll_for_status("live") == "success"
                assert client.poll_for_status("head_server") == "connection_error"
                watch.wait_for_stderr("retrying", RECOVERY_SECONDS)

                with running_head(path, "--port", str(port)) as second:
                    assert second.address == address  # the port could be bound again at once
                    instances = eventually_blocking(
                        control.list_server_instances,
                        lambda rows: rows[0].pid == second.process.pid,
                        within=RECOVERY_SECONDS,
                        every=0.1,
                        ignoring=(ControlPlaneError, OSError),
                    )
                    assert [row.name for row in instances] == ["head_server", "live"]
                    eventually_blocking(
                        lambda: client.poll_for_status("live"),
                        lambda status: status == "success",
                        within=RECOVERY_SECONDS,
                        every=0.1,
                        ignoring=(ControlPlaneError, OSError),
                    )
                    assert client.poll_for_status("head_server") == "success"
                    # The watch resumes by itself, with a fresh snapshot from the new head.
                    resumed = watch.wait_for_line(re.compile(r'"kind": "snapshot"'), RECOVERY_SECONDS)
                    assert [row["name"] for row in json.loads(resumed.string)["servers"]] == ["live"]
                    assert watch.process.poll() is None


# --- the head not there at all ---


async def test_refused_head_fails_at_once_naming_the_address() -> None:
    address = f"{LOOPBACK}:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(HeadUnreachableError, match=re.escape(address)):
        await asyncio.to_thread(SyncControlClient(address, timeout_seconds=3.0).get_global_config)
    with pytest.raises(HeadUnreachableError, match=re.escape(address)):
        await ControlClient(address, timeout_seconds=3.0).list_server_statuses()
    head = BaseServerConfig(host=LOOPBACK, port=int(address.rsplit(":", 1)[1]))
    with pytest.raises(HeadUnreachableError, match=re.escape(address)):
        await asyncio.to_thread(ServerClient.load_from_global_config, head)
    assert time.monotonic() - started < 6.0  # refused is known at once: no call waits for its deadline


async def test_silent_head_fails_within_the_deadline_naming_the_address(silent_server: int) -> None:
    address = f"{LOOPBACK}:{silent_server}"
    for call in (
        lambda: asyncio.to_thread(SyncControlClient(address, timeout_seconds=1.0).list_server_instances),
        lambda: ControlClient(address, timeout_seconds=1.0).get_head_server_config(),
    ):
        started = time.monotonic()
        with pytest.raises(HeadUnreachableError, match=re.escape(address)) as caught:
            await call()
        assert time.monotonic() - started < 1.0 + 3.0  # the 1 s deadline plus slack for a loaded machine
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert isinstance(caught.value, HeadTimeoutError) and isinstance(caught.value, TimeoutError)
        assert isinstance(caught.value.__cause__, grpc.RpcError)  # the original error is kept


async def test_poll_for_status_says_timeout_when_the_head_answers_too_late(silent_server: int) -> None:
    head = BaseServerConfig(host=LOOPBACK, port=silent_server)
    doc = {"policy": server_entry(closed_port())}
    client = ServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))
    assert await asyncio.to_thread(client.poll_for_status, "policy", 1.0) == "timeout"


# --- a data-plane server killed in the middle of a request ---

SLOW_SERVER = """
import asyncio
from aiohttp import web

SITES = []

async def slow(request):
    # Stop listening first (the connection stays): a resend after the kill is refused, never accepted by a port
    # the dying process has not closed yet (the kernel closes its sockets one by one).
    await SITES[0].stop()
    print("in flight", flush=True)
    await asyncio.sleep(60)
    return web.Response(text="too late")

async def main():
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", slow)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    SITES.append(web.TCPSite(runner, "127.0.0.1", 0))
    await SITES[0].start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def _read_line(process: asyncio.subprocess.Process, timeout: float) -> str:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), timeout)
    assert line, f"the data server ended early (exit {process.returncode})"
    return line.decode().strip()


@pytest.fixture
async def slow_server() -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """A real aiohttp server in its own process whose first request takes a minute, and which stops listening
    when that request arrives."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SLOW_SERVER, stdout=asyncio.subprocess.PIPE
    )
    try:
        yield process, int(await _read_line(process, STARTUP_SECONDS))
    finally:
        if process.returncode is None:
            process.kill()
        await asyncio.wait_for(process.wait(), 10.0)
        await close_http_sessions()


@pytest.mark.parametrize("resend", [True, False])
async def test_data_server_killed_mid_request_is_a_clear_error_never_a_hang(slow_server, resend: bool) -> None:
    process, port = slow_server
    retry = {"attempts": 3, "initial_backoff_seconds": 0.01, "max_backoff_seconds": 0.05}
    doc = document({"slow": server_entry(port)}, http_client={"retry": retry})
    client = ServerClient._from_global_config(
        BaseServerConfig(host=LOOPBACK, port=closed_port()), GlobalConfig.from_document(doc)
    )
    request = asyncio.create_task(
        client.request("slow", "/v1/responses", "POST", _resend_after_disconnect=resend, json={})
    )
    assert await _read_line(process, 10.0) == "in flight"
    started = time.monotonic()
    process.kill()
    if resend:
        # Resent after the disconnect, then refused: the server is gone, and the error names where it was. The
        # legacy `attempts` is each kind's: 1 dropped after written, then 3 refused.
        with pytest.raises(ServerUnreachableError, match=f"127.0.0.1:{port}") as caught:
            await asyncio.wait_for(request, 10.0)
        assert (caught.value.attempts, caught.value.limit) == (4, "attempts")
    else:
        with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
            await asyncio.wait_for(request, 10.0)
    assert time.monotonic() - started < 5.0


# --- one client cannot take everything ---


def watch_stream(client: ControlClient, **options: Any) -> AsyncGenerator[WatchEvent, None]:
    """The client's watch, typed as what it is (an async generator), so a test can close it."""
    return client.watch_server_statuses(**options)


async def test_oversized_request_is_refused_and_the_head_keeps_serving(head_factory) -> None:
    head = await head_factory(document({}))
    huge = pb.GetServerStatusRequest(server_name="x" * (MAX_REQUEST_BYTES + 1)).SerializeToString()
    # A client of its own, without gym_rpc's send limit, so the head's own limit is what answers.
    async with grpc.aio.insecure_channel(head.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            method = channel.unary_unary(f"/{SERVICE_NAME}/GetServerStatus", None, None)
            await method(huge, timeout=5.0)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # gym_rpc's own client refuses to send it at all.
    with pytest.raises(ControlPlaneError, match="RESOURCE_EXHAUSTED"):
        await ControlClient(head.address).get_server_status("x" * (MAX_REQUEST_BYTES + 1))
    assert (await ControlClient(head.address).list_server_statuses()).reports == []


async def test_watches_beyond_the_bound_are_refused_until_one_ends(head_factory) -> None:
    head = await head_factory(document({}), max_concurrent_watches=2)
    client = ControlClient(head.address, timeout_seconds=5.0)
    watches = [watch_stream(client, heartbeat_seconds=0.05) for _ in range(2)]
    for watch in watches:
        assert (await anext(watch)).kind == "snapshot"
    with pytest.raises(ControlPlaneError, match="RESOURCE_EXHAUSTED") as caught:
        await anext(client.watch_server_statuses())
    assert "2 status watches" in str(caught.value)
    assert (await client.list_server_statuses()).reports == []  # unary calls are not affected

    await watches[0].aclose()  # one ends: its slot comes free
    deadline = time.monotonic() + 5.0
    while True:
        try:
            fresh = watch_stream(client)
            assert (await anext(fresh)).kind == "snapshot"
            await fresh.aclose()
            break
        except ControlPlaneError:
            assert time.monotonic() < deadline, "the ended watch never gave its slot back"
            await asyncio.sleep(0.05)
    await watches[1].aclose()


async def test_a_client_pinging_too_often_is_cut_off_and_others_are_served(head_factory) -> None:
    head = await head_factory(document({}))
    flood = [
        ("grpc.keepalive_time_ms", 100),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    polite = ControlClient(head.address, timeout_seconds=2.0)
    async with grpc.aio.insecure_channel(head.address, options=flood) as channel:
        request = pb.WatchServerStatusesRequest()
        request.heartbeat_interval.FromSeconds(30)  # no data flows after the snapshot: only pings
        stream = channel.unary_stream(
            f"/{SERVICE_NAME}/WatchServerStatuses",
            request_serializer=pb.WatchServerStatusesRequest.SerializeToString,
            response_deserializer=pb.WatchServerStatusesResponse.FromString,
        )(request, timeout=15.0)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stream:
                assert (await polite.list_server_statuses()).reports == []
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # GOAWAY: too many pings
        assert time.monotonic() - started < 12.0
    assert (await polite.list_server_statuses()).reports == []


async def test_a_config_larger_than_a_request_may_be_still_arrives(head_factory) -> None:
    note = "n" * (MAX_REQUEST_BYTES + 1024)  # beyond gRPC's default 4 MiB receive limit
    head = await head_factory(document({"big": server_entry(closed_port(), note=note)}))
    config = await ControlClient(head.address).get_global_config()
    assert config.servers["big"].config["note"] == note


async def test_a_second_process_cannot_share_the_heads_port(head_factory) -> None:
    head = await head_factory(document({}))
    intruder = HeadServer(GlobalConfig.from_document(document({})), HeadOptions(port=head.port))
    with pytest.raises(GymRpcError, match=f"cannot listen on {re.escape(head.address)}"):
        await intruder.start()
    await intruder.stop()
    assert (await ControlClient(head.address).list_server_statuses()).reports == []
