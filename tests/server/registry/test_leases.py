"""Registration leases against a real head: a registration that is not renewed expires, is dropped with its
advertised address, is logged, and is reported in status watches; renewals keep it, and bad leases are refused."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gym_rpc.client.control._channel import CHANNEL_OPTIONS
from gym_rpc.client.control._clients import ControlClient, SyncControlClient, WatchEvent
from gym_rpc.config import BaseServerConfig
from gym_rpc.errors import HeadUnreachableError
from gym_rpc.integrations._registration import ServerRegistration
from gym_rpc.v1 import control_plane_pb2 as pb
from tests.support import REPO_ROOT
from tests.support.cli import running_head
from tests.support.documents import document, server_entry
from tests.support.heads import raw_stub
from tests.support.loopback import LOOPBACK, closed_port

RECONNECT_BACKOFF_SECONDS = int(dict(CHANNEL_OPTIONS)["grpc.max_reconnect_backoff_ms"]) / 1000  # 2 s

SERVER_SCRIPT = """
import sys
from aiohttp import web
from gym_rpc.integrations._registration import register_aiohttp_app

async def answer(request):
    return web.Response(text="ok")

app = web.Application()
app.router.add_route("*", "/{tail:.*}", answer)
register_aiohttp_app(app, "policy", int(sys.argv[2]), head=sys.argv[1], refresh_seconds=0.3, lease_seconds=1.0)
web.run_app(app, host="0.0.0.0", port=int(sys.argv[2]), print=None, access_log=None)
"""


def wildcard_doc(config_port: int) -> dict[str, Any]:
    """`policy` binds 0.0.0.0 on a port nothing listens on: only its registration says where it really is."""
    return document({"policy": server_entry(config_port, host="0.0.0.0")})


async def next_policy_report(events: AsyncGenerator[WatchEvent, None], registration: str, timeout: float) -> Any:
    """The first watched report of `policy` whose registration state is `registration` (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"policy never reported registration={registration}"
        event = await asyncio.wait_for(anext(events), remaining)
        for report in event.reports:
            if report.server_name == "policy" and report.registration == registration:
                return report


async def test_a_lease_expires_when_its_process_is_killed_9(head_factory, caplog):
    caplog.set_level(logging.INFO, logger="gym_rpc.head")
    config_port, real_port = closed_port(), closed_port()
    head = await head_factory(wildcard_doc(config_port))
    client = ControlClient(head.address)
    events = client.watch_server_statuses(heartbeat_seconds=0.5)
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER_SCRIPT,
        head.address,
        str(real_port),
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        registered = await next_policy_report(events, "registered", timeout=30)
        assert registered.advertised_url == f"http://{LOOPBACK}:{real_port}"
        await asyncio.sleep(1.5)  # longer than the lease: renewals keep it
        assert head.registry.state("policy") == "registered"

        server.send_signal(signal.SIGKILL)  # no deregistration, no cleanup
        killed_at = time.monotonic()
        expired = await next_policy_report(events, "expired", timeout=15)
        waited = time.monotonic() - killed_at
    finally:
        if server.returncode is None:
            server.kill()
        await asyncio.wait_for(server.wait(), 10)
        await events.aclose()

    assert expired.advertised_url == ""
    assert expired.url == f"http://0.0.0.0:{config_port}".replace("0.0.0.0", LOOPBACK)  # back to the config
    assert waited > 0.5  # not before the last renewal's lease ran out
    assert head.registry.get("policy") is None
    (instance,) = [i for i in await client.list_server_instances() if i.name == "policy"]
    assert (instance.advertised_url, instance.pid) == ("", 0)
    expiries = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
    assert len(expiries) == 1 and expiries[0].startswith(f"policy: lease of pid {server.pid} expired")
    assert caplog.records[[r.getMessage() for r in caplog.records].index(expiries[0])].levelname == "WARNING"


async def test_renewals_are_neither_watched_nor_logged_and_a_clean_stop_says_deregistered(head_factory, caplog):
    caplog.set_level(logging.INFO, logger="gym_rpc.head")
    head = await head_factory(wildcard_doc(closed_port()))
    registration = ServerRegistration(
        "policy",
        closed_port(),
        head=BaseServerConfig(host=LOOPBACK, port=head.port),
        refresh_seconds=0.2,
        lease_seconds=0.6,
    )
    await registration.aregister()
    await asyncio.sleep(0.3)
    revision = head.prober.revision
    reports_before = head.prober.report("policy")
    await asyncio.sleep(1.5)  # several renewals, each within the lease
    assert head.registry.state("policy") == "registered"
    assert head.prober.report("policy").registration == reports_before.registration == "registered"
    registered_lines = [r for r in caplog.records if ": registered pid" in r.getMessage()]
    assert len(registered_lines) == 1  # the first registration only
    assert head.prober.revision - revision <= 2  # status probes may change; renewals record nothing

    assert await registration.aderegister()
    report = head.prober.report("policy")
    assert (report.registration, report.advertised_url) == ("deregistered", "")
    assert head.registry.get("policy") is None


async def test_a_lease_outside_the_bounds_is_refused(head_factory):
    head = await head_factory(wildcard_doc(closed_port()))
    request = pb.RegisterServerInstanceRequest(server_name="policy", listen_port=closed_port())
    for seconds in (0.1, 100_000.0):
        request.lease_ttl.FromNanoseconds(int(seconds * 1e9))
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await raw_stub(head).RegisterServerInstance(request, timeout=5)
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raw.value.details() == f"lease_ttl must be between 0.5 s and 86400 s, got {seconds:g} s"
    assert head.registry.get("policy") is None

    request.lease_ttl.FromNanoseconds(2_000_000_000)
    response = await raw_stub(head).RegisterServerInstance(request, timeout=5)
    assert response.lease_ttl.ToNanoseconds() == 2_000_000_000  # the lease granted


def test_the_helper_refuses_a_lease_its_renewals_cannot_keep() -> None:
    with pytest.raises(ValueError, match=r"lease_seconds \(1\) must be longer than refresh_seconds \(2\)"):
        ServerRegistration("policy", 8000, head="127.0.0.1:1", refresh_seconds=2.0, lease_seconds=1.0)
    with pytest.raises(ValueError, match="lease_seconds must be >= 0"):
        ServerRegistration("policy", 8000, head="127.0.0.1:1", lease_seconds=-1.0)
    default = ServerRegistration("policy", 8000, head="127.0.0.1:1")
    assert (default.refresh_seconds, default.lease_seconds) == (10.0, 30.0)
    unrefreshed = ServerRegistration("policy", 8000, head="127.0.0.1:1", refresh_seconds=None)
    assert unrefreshed.lease_seconds is None  # nothing renews it, so it does not expire


async def test_an_expired_server_registering_again_is_registered(head_factory):
    head = await head_factory(wildcard_doc(closed_port()))
    stub = raw_stub(head)
    request = pb.RegisterServerInstanceRequest(server_name="policy", listen_port=closed_port(), pid=4242)
    request.lease_ttl.FromNanoseconds(500_000_000)
    await stub.RegisterServerInstance(request, timeout=5)
    deadline = time.monotonic() + 10
    while head.registry.state("policy") != "expired":
        assert time.monotonic() < deadline, "the lease never expired"
        await asyncio.sleep(0.05)
    assert head.prober.report("policy").registration == "expired"
    await stub.RegisterServerInstance(request, timeout=5)  # e.g. the head was slow, the process is alive
    assert head.registry.state("policy") == "registered"
    assert head.prober.report("policy").registration == "registered"


class CountedRegistration(ServerRegistration):
    """The helper as shipped, recording when each renewal started and whether it reached a head."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.renewals: list[
            tuple[float, bool | None]
        ] = []  # (time.monotonic() at its start, None while under way)

    def _refresh(self, quiet: bool) -> bool:
        index = len(self.renewals)  # renewals never overlap: the helper awaits each before sleeping again
        self.renewals.append((time.monotonic(), None))
        reached = super()._refresh(quiet)
        self.renewals[index] = (self.renewals[index][0], reached)
        return reached


def advertised(address: str) -> str:
    """What the head at `address` advertises for `policy` ("" when it has no registration of it, or this
    process's channel to it is still backing off from the dead head)."""
    try:
        instances = SyncControlClient(address, timeout_seconds=5).list_server_instances()
    except HeadUnreachableError:
        return ""
    return next(i.advertised_url for i in instances if i.name == "policy")


async def test_a_restarted_head_learns_registrations_again_at_the_next_renewal(tmp_path: Path, caplog) -> None:
    """A head killed -9 and started again (a new process on the same port, knowing nothing) advertises the server
    again from a renewal, with no new registration: the first renewal once it serves, unless this process's
    channel to the head is still waiting out its reconnect backoff then (it keeps redialling the gone head, at most
    2 s apart plus gRPC's 20 % jitter): every renewal that starts after that reaches the new head."""
    caplog.set_level(logging.WARNING, logger="gym_rpc.integrations")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(wildcard_doc(closed_port())), encoding="utf-8")
    real_port = closed_port()
    with running_head(config) as first:
        registration = CountedRegistration("policy", real_port, head=first.address, refresh_seconds=2.5)
        assert await registration.aregister()
        try:
            assert await asyncio.to_thread(advertised, first.address) == f"http://{LOOPBACK}:{real_port}"
            first.process.kill()  # a crash: nothing tells anyone
            await asyncio.to_thread(first.process.wait, 10)
            port = first.address.rsplit(":", 1)[1]
            deadline = time.monotonic() + 30
            while not registration.renewals or registration.renewals[-1][1] is not False:
                assert time.monotonic() < deadline, "no renewal found the head gone"
                await asyncio.sleep(0.05)  # a renewal failed: the helper knows the head is gone

            with running_head(config, "--port", port) as second:
                serving_since = time.monotonic()  # at the latest: its "listening" line has been read
                assert second.address == first.address
                while await asyncio.to_thread(advertised, second.address) == "":
                    assert time.monotonic() < deadline + 30, f"never registered again: {registration.renewals}"
                    await asyncio.sleep(0.05)
                while not any(reached for _, reached in registration.renewals):  # a renewal did it (recorded soon)
                    assert time.monotonic() < deadline + 30, registration.renewals
                    await asyncio.sleep(0.05)
        finally:
            await registration.aderegister()

    backed_off_until = serving_since + RECONNECT_BACKOFF_SECONDS * 1.2
    failed_later = [
        round(started - serving_since, 2)
        for started, reached in registration.renewals
        if reached is False and started >= backed_off_until
    ]
    assert failed_later == [], registration.renewals
    assert "registered with the head at" in caplog.text and "again" in caplog.text
