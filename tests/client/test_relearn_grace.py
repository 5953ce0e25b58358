"""A worker keeps the instances a fresh head has not relearned yet for a grace (issue 40: a restart is invisible):
the rule on fixed times, then a real follower whose head comes back without its registrations."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from gym_rpc.client import ControlClient, ServerClient, _relearn_grace
from gym_rpc.client._relearn_grace import RelearnGrace
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.wire import InstanceReport, StatusReport
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

NAME = "sessions"


def _report(*ids: str, name: str = NAME) -> StatusReport:
    instances = tuple(InstanceReport(i, f"http://{i}", status="success", origin="registered") for i in ids)
    return StatusReport(name, "success", f"http://{ids[0]}" if ids else "", instances=instances)


def _ids(reports: list[StatusReport], name: str = NAME) -> list[str]:
    [report] = [r for r in reports if r.server_name == name]
    return [i.instance_id for i in report.instances]


def test_a_snapshot_that_leaves_out_known_instances_keeps_them_until_the_grace_runs_out() -> None:
    grace = RelearnGrace(10.0)
    known = {NAME: _report("a:1", "b:2", "c:3")}
    merged = grace.snapshot(known, [_report("a:1")], now=100.0)
    assert _ids(merged) == ["a:1", "b:2", "c:3"]  # kept, as they were
    assert grace.next_expiry() == 110.0
    # A change of the server while they are kept still carries them.
    assert _ids(grace.merged([_report("a:1")], now=105.0)) == ["a:1", "b:2", "c:3"]
    # Another snapshot before the grace ran out does not restart it.
    grace.snapshot({NAME: _report("a:1", "b:2", "c:3")}, [_report("a:1")], now=108.0)
    assert grace.next_expiry() == 110.0
    assert grace.expired({NAME: _report("a:1", "b:2", "c:3")}, now=109.0) == []
    [after] = grace.expired({NAME: _report("a:1", "b:2", "c:3")}, now=110.0)
    assert [i.instance_id for i in after.instances] == ["a:1"]
    assert not grace and grace.next_expiry() is None


def test_the_head_listing_an_instance_again_ends_its_grace() -> None:
    grace = RelearnGrace(10.0)
    grace.snapshot({NAME: _report("a:1", "b:2", "c:3")}, [_report("a:1")], now=0.0)
    assert _ids(grace.merged([_report("a:1", "b:2")], now=1.0)) == ["a:1", "b:2", "c:3"]
    assert grace.kept(NAME) == ["c:3"]
    # From then on the head's word: a change without b:2 (deregistered) drops it at once.
    assert _ids(grace.merged([_report("a:1")], now=2.0)) == ["a:1", "c:3"]


def test_nothing_is_kept_of_a_server_the_snapshot_leaves_out_or_of_a_first_view() -> None:
    grace = RelearnGrace(10.0)
    merged = grace.snapshot(
        {NAME: _report("a:1", "b:2"), "gone": _report("g:1", name="gone")}, [_report("a:1")], 0
    )
    assert _ids(merged) == ["a:1", "b:2"] and [r.server_name for r in merged] == [NAME]
    grace.snapshot({NAME: _report("a:1", "b:2")}, [_report("x:9", name="other")], now=1.0)
    assert not grace  # the server itself left the config: nothing of it kept
    assert _ids(RelearnGrace(10.0).snapshot({}, [_report("a:1")], now=0.0)) == ["a:1"]


async def test_a_follower_keeps_what_a_fresh_head_does_not_list_then_drops_it_when_the_grace_runs_out(
    head_factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real follower: its head stops and another starts on its port without the registration (no file). The
    follower keeps the instance (it says so), and drops it once the grace (0.5 s here) ran out."""
    monkeypatch.setattr(_relearn_grace, "DEFAULT_GRACE_SECONDS", 0.5)
    caplog.set_level(logging.INFO, logger="gym_rpc.client.replicas")
    doc = document({NAME: server_entry(closed_port(), "resources_servers")})
    first = await head_factory(doc, keep_registrations=False)
    registered = closed_port()
    await ControlClient(first.address).register_instance(
        NAME, listen_port=registered, listen_host=LOOPBACK, pid=4242, lease_seconds=600.0
    )
    client = ServerClient._from_global_config(
        BaseServerConfig(host=LOOPBACK, port=first.port), GlobalConfig.from_document(doc)
    )
    client.follow_instances(True)
    try:
        deadline = time.monotonic() + 30
        routing = await client._endpoints.ready_routing()  # subscribed to the process's follower of the head

        def instance_ids() -> list[str]:
            route = routing.routes.get(NAME)
            return [] if route is None else [i.instance_id for i in route.instances]

        while f"{LOOPBACK}:{registered}" not in instance_ids():
            assert time.monotonic() < deadline, instance_ids()
            await asyncio.sleep(0.05)
        await first.stop()
        await head_factory(doc, port=first.port, keep_registrations=False)
        while "does not list 1 instances it had" not in caplog.text:  # the new head's snapshot, without it
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.05)
        while f"{LOOPBACK}:{registered}" in instance_ids():  # dropped once the grace ran out
            assert time.monotonic() < deadline, instance_ids()
            await asyncio.sleep(0.05)
        assert "has not listed again" in caplog.text
    finally:
        await client.aclose()
