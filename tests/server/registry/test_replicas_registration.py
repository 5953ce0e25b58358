"""Registrations per instance against a real head (in-process grpc.aio) and real aiohttp instances: a process at a
new address adds an instance, one at a held address replaces it, leases and deregistration are per instance,
labels are bounded, two instances of one server may not disagree on its type, a registration may say it drains,
and a replica killed -9 is marked down by the probe, then dropped by its lease, each one revision on the watch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any

import grpc
import pytest

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.errors import ControlPlaneError
from gym_rpc.integrations._registration import ServerRegistration
from gym_rpc.server._head import HeadServer
from gym_rpc.wire import StatusReport
from tests.support import REPO_ROOT
from tests.support.documents import document, server_entry
from tests.support.heads import (
    authority,
    health_of,
    next_report,
    rewrite_config,
    wait_for_report,
    watching,
)
from tests.support.loopback import LOOPBACK, closed_port

# A replica process: an aiohttp server on the given port that registers `policy` with the head, renewing every
# 0.3 s on a 1 s lease, as the registration helper does.
REPLICA_SCRIPT = """
import sys
from aiohttp import web
from gym_rpc.integrations import register_aiohttp_app

async def answer(request):
    return web.Response(text="ok")

app = web.Application()
app.router.add_route("*", "/{tail:.*}", answer)
register_aiohttp_app(
    app, "policy", int(sys.argv[2]), head=sys.argv[1], listen_host="127.0.0.1", refresh_seconds=0.3,
    lease_seconds=1.0,
)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
"""


def rows_of(instances: list[Any]) -> list[tuple[str, str | None, int]]:
    return [(row.instance_id, row.origin, row.pid) for row in instances if row.name == "policy"]


def instances_of(report: StatusReport) -> list[tuple[str, str | None, int]]:
    return [(i.instance_id, i.origin, i.pid) for i in report.instances]


async def register(head: HeadServer, port: int, pid: int, **options: Any) -> str:
    """Register `policy` at 127.0.0.1:`port` as process `pid`; the instance id the head answers."""
    client = ControlClient(head.address)
    registered = await client.register_instance(
        "policy", listen_port=port, listen_host=LOOPBACK, pid=pid, **options
    )
    return registered.instance_id


async def test_a_new_address_adds_an_instance_and_a_held_one_is_replaced(head_factory, http_server, caplog):
    caplog.set_level(logging.INFO, logger="gym_rpc.head")
    config_port, first, second = await http_server(), await http_server(), await http_server()
    # One probe round at the start only: revisions here come from registrations alone.
    head = await head_factory(document({"policy": server_entry(config_port)}), probe_interval_seconds=3600)
    await wait_for_report(head, lambda r: r.status is not None, "the first probe round done")
    revision = head.prober.revision

    assert await register(head, first, 101) == authority(first)  # a replica, after the config's instance
    assert await register(head, second, 102) == authority(second)  # another, in the order they came
    assert await register(head, first, 103) == authority(first)  # a restart at a held address: replaced
    assert head.prober.revision == revision + 3
    await register(head, first, 103)  # a renewal: no change
    assert head.prober.revision == revision + 3
    assert await register(head, config_port, 104) == authority(config_port)  # the config instance's process
    assert head.prober.revision == revision + 4

    expected = [
        (authority(config_port), "config", 104),
        (authority(first), "registered", 103),
        (authority(second), "registered", 102),
    ]
    assert instances_of(head.prober.report("policy")) == expected
    assert rows_of(await ControlClient(head.address).list_server_instances()) == expected
    lines = [r.getMessage() for r in caplog.records if "registered pid" in r.getMessage()]
    assert lines == [
        f"policy: registered pid 101 at http://{authority(first)} ({authority(first)}, 2 instances)",
        f"policy: registered pid 102 at http://{authority(second)} ({authority(second)}, 3 instances)",
        f"policy: registered pid 103 at http://{authority(first)} ({authority(first)}, 3 instances), "
        "replacing pid 101",
        f"policy: registered pid 104 at http://{authority(config_port)} ({authority(config_port)}, 3 instances)",
    ]


async def test_deregistration_removes_only_the_instance_it_names(head_factory, http_server) -> None:
    config_port, first, second = await http_server(), await http_server(), await http_server()
    head = await head_factory(document({"policy": server_entry(config_port)}))
    client = ControlClient(head.address)
    for port, pid in ((config_port, 7), (first, 7), (second, 8)):
        await register(head, port, pid)

    assert await client.deregister_server_instance("policy", pid=8, instance_id=authority(first)) is False
    assert await client.deregister_server_instance("policy", pid=7, instance_id=authority(first)) is True
    report = head.prober.report("policy")
    assert instances_of(report) == [(authority(config_port), "config", 7), (authority(second), "registered", 8)]
    assert await client.deregister_server_instance("policy", pid=7) is True  # no instance named: all of pid 7
    report = head.prober.report("policy")
    # The config instance stays (it is the config's), saying its process deregistered.
    assert [(i.instance_id, i.registration, i.pid) for i in report.instances] == [
        (authority(config_port), "deregistered", 0),
        (authority(second), "registered", 8),
    ]
    assert report.registration == "deregistered"


async def test_a_config_host_name_is_held_by_a_registration_from_its_address(head_factory, http_server) -> None:
    """`localhost` in the config, a process registering from 127.0.0.1: one instance, not two."""
    port = await http_server()
    head = await head_factory(document({"policy": server_entry(port, host="localhost")}))
    assert await register(head, port, 55) == f"localhost:{port}"
    report = head.prober.report("policy")
    assert [(i.instance_id, i.origin, i.registration, i.pid) for i in report.instances] == [
        (f"localhost:{port}", "config", "registered", 55)
    ]
    assert report.advertised_url == f"http://{authority(port)}"


async def test_a_static_replica_is_held_by_the_process_at_its_address(head_factory, http_server) -> None:
    config_port, replica = await http_server(), await http_server()
    head = await head_factory(document({"policy": server_entry(config_port, replicas=[f"{LOOPBACK}:{replica}"])}))
    assert await register(head, replica, 66) == authority(replica)
    assert [(i.instance_id, i.origin, i.registration, i.pid) for i in head.prober.report("policy").instances] == [
        (authority(config_port), "config", None, 0),
        (authority(replica), "static_replica", "registered", 66),
    ]


async def test_a_wildcard_servers_config_instance_passes_to_the_next_registered_process(head_factory, http_server):
    """Bound to 0.0.0.0, the config instance is where its earliest registration came from; when that process
    deregisters, the next registered instance takes its place (keeping its id, so its rollouts stay); when none is
    left, the config instance is back at the config's address."""
    config_port, first, second = closed_port(), await http_server(), await http_server()
    head = await head_factory(document({"policy": server_entry(config_port, host="0.0.0.0")}))
    client = ControlClient(head.address)
    await register(head, first, 1)
    await register(head, second, 2)
    report = head.prober.report("policy")
    assert instances_of(report) == [(authority(first), "config", 1), (authority(second), "registered", 2)]
    assert (report.url, report.advertised_url) == (f"http://{authority(first)}", f"http://{authority(first)}")

    assert await client.deregister_server_instance("policy", pid=1, instance_id=authority(first))
    assert instances_of(head.prober.report("policy")) == [(authority(second), "config", 2)]
    assert await client.deregister_server_instance("policy", pid=2, instance_id=authority(second))
    report = head.prober.report("policy")
    assert [(i.instance_id, i.registration) for i in report.instances] == [
        (authority(config_port), "deregistered")
    ]
    assert (report.url, report.registration) == (f"http://{authority(config_port)}", "deregistered")


async def test_labels_are_reported_and_a_change_of_them_is_one_revision(head_factory, http_server, caplog):
    caplog.set_level(logging.INFO, logger="gym_rpc.head")
    config_port, replica = await http_server(), await http_server()
    head = await head_factory(document({"policy": server_entry(config_port)}), probe_interval_seconds=3600)
    await wait_for_report(head, lambda r: r.status is not None, "the first probe round done")
    await register(head, replica, 9, labels={"weights_version": "41", "zone": "a"})
    revision = head.prober.revision
    await register(head, replica, 9, labels={"weights_version": "41", "zone": "a"})  # a renewal: no change
    assert head.prober.revision == revision
    await register(head, replica, 9, labels={"weights_version": "42", "zone": "a"})  # a refit
    assert head.prober.revision == revision + 1
    (_, instance) = head.prober.report("policy").instances
    assert instance.labels == {"weights_version": "42", "zone": "a"}
    (_, row) = [r for r in await ControlClient(head.address).list_server_instances() if r.name == "policy"]
    assert row.labels == {"weights_version": "42", "zone": "a"}
    assert any(
        r.getMessage().endswith(f"({authority(replica)}, 2 instances) has labels weights_version=42, zone=a")
        for r in caplog.records
    )


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        ({f"k{i}": "v" for i in range(17)}, "17 labels, more than the 16"),
        ({"-version": "1"}, "label '-version': a key is letters"),
        ({"version-": "1"}, "label 'version-': a key is letters"),
        ({"weights version": "1"}, "label 'weights version': a key is letters"),
        ({"": "1"}, "label '': a key is letters"),
        ({"k" * 64: "1"}, f"label '{'k' * 63}...': the key is longer than 63 characters"),
        ({"version": "x" * 257}, "label 'version': the value is longer than 256 characters"),
        ({"version": "4\n2"}, "label 'version': the value has a character that is not printable"),
    ],
)
async def test_bad_labels_are_refused_naming_the_label(head_factory, labels: dict[str, str], named: str) -> None:
    head = await head_factory(document({"policy": server_entry(closed_port())}))
    with pytest.raises(ControlPlaneError) as refused:
        await register(head, closed_port(), 5, labels=labels)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"policy: {named}" in str(refused.value)
    assert len(head.prober.report("policy").instances) == 1  # nothing was registered
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        ServerRegistration("policy", 1, head=head.address, labels=labels)  # the helper says so before asking


async def test_labels_at_their_bounds_are_taken(head_factory) -> None:
    head = await head_factory(document({"policy": server_entry(closed_port())}))
    labels = {f"k.{i}/x_y-{'z' * 50}": "v" * 256 for i in range(16)}
    await register(head, closed_port(), 5, labels=labels)
    assert head.prober.report("policy").instances[1].labels == labels


async def test_two_instances_that_disagree_on_the_server_type_are_refused_naming_both(head_factory) -> None:
    head = await head_factory(document({"policy": server_entry(closed_port(), "responses_api_models")}))
    port = closed_port()
    with pytest.raises(ControlPlaneError) as refused:
        await register(head, port, 5, server_type="resources_servers")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    message = str(refused.value)
    assert f"policy: the instance registering at {authority(port)} serves as resources_servers" in message
    assert "but policy is responses_api_models" in message
    assert len(head.prober.report("policy").instances) == 1
    await register(head, port, 5, server_type="responses_api_models")  # the config's type: taken
    await register(head, closed_port(), 6)  # no type said: taken
    assert len(head.prober.report("policy").instances) == 3


async def test_a_draining_registration_marks_its_instance_and_undrains_when_it_says_so(head_factory, http_server):
    config_port, replica = closed_port(), await http_server()
    head = await head_factory(document({"policy": server_entry(config_port)}))
    await register(head, replica, 9)
    await wait_for_report(head, lambda r: r.status == "success", "the replica up")
    assert await health_of(head, "policy") == 1  # SERVING: the replica answers
    revision = head.prober.revision
    await register(head, replica, 9, draining=True)
    assert [i.draining for i in head.prober.report("policy").instances] == [False, True]
    assert head.prober.revision == revision + 1
    assert await health_of(head, "policy") == 2  # NOT_SERVING: the one that answers gets no new work
    await register(head, replica, 9)  # it changed its mind (a cancelled shutdown)
    assert [i.draining for i in head.prober.report("policy").instances] == [False, False]


async def test_a_replica_killed_9_is_marked_down_by_its_probe_then_dropped_by_its_lease(head_factory, http_server):
    """Two replica processes; one is killed -9. The probe marks it down first (within a few probe intervals),
    then its lease (1 s, renewed every 0.3 s) runs out and it is dropped, each one revision; the other replica
    is untouched throughout, and a watch resumed from before the kill replays both."""
    config_port = await http_server()
    head = await head_factory(document({"policy": server_entry(config_port)}))
    client = ControlClient(head.address)
    ports = [closed_port(), closed_port()]
    replicas = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            REPLICA_SCRIPT,
            head.address,
            str(port),
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        for port in ports
    ]
    try:
        up = await wait_for_report(
            head,
            lambda r: [i.status for i in r.instances] == ["success"] * 3,
            "both replicas registered and up",
            timeout=60,
        )
        killed, survivor = up.instances[1], up.instances[2]
        victim = next(p for p in replicas if p.pid == killed.pid)
        before = head.prober.revision
        async with watching(client, before, heartbeat_seconds=0.2) as events:
            victim.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            down_revision, down = await next_report(events)
            noticed_down = time.monotonic() - killed_at
            gone_revision, gone = await next_report(events)
            noticed_gone = time.monotonic() - killed_at
        assert [(i.instance_id, i.status) for i in down.instances] == [
            (authority(config_port), "success"),
            (killed.instance_id, "connection_error"),
            (survivor.instance_id, "success"),
        ]
        assert [(i.instance_id, i.status, i.pid) for i in gone.instances] == [
            (authority(config_port), "success", 0),
            (survivor.instance_id, "success", survivor.pid),
        ]
        assert (down_revision, gone_revision) == (before + 1, before + 2)  # one revision each, nothing between
        assert noticed_down < noticed_gone  # the probe first (every 0.1 s here), then the lease
        assert noticed_gone > 0.5  # not before the last renewal's lease could have run out
        async with watching(client, before, heartbeat_seconds=0.2) as resumed:
            replayed_revision, replayed = await next_report(resumed)
        assert (replayed_revision, instances_of(replayed)) == (gone_revision, instances_of(gone))
    finally:
        for process in replicas:
            if process.returncode is None:
                process.kill()
            await asyncio.wait_for(process.wait(), 10)


async def test_a_process_whose_config_instance_a_reload_moved_stays_an_instance_at_its_own_address(
    head_factory, http_server
) -> None:
    """Held by its registration from 127.0.0.1, `localhost:P` moves to another port in a reload: the process is a
    registered instance at the address it registered (its id that address's, not the config's old one)."""
    port = await http_server()
    head = await head_factory(document({"policy": server_entry(port, host="localhost")}))
    await register(head, port, 55)
    rewrite_config(head, document({"policy": server_entry(closed_port(), host="localhost")}))
    assert (await ControlClient(head.address).reload_global_config())[1] is True
    _, moved = head.prober.report("policy").instances
    assert (moved.instance_id, moved.url, moved.origin, moved.pid) == (
        authority(port),
        f"http://{authority(port)}",
        "registered",
        55,
    )
