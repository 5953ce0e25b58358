"""The head tracks every instance of a server: its static replicas (the config's `replicas:` key) probed each on
its own, reported in every status report (`instances`, the config's first), one revision per instance change on
the watch, one ListServerInstances row per instance, and the name SERVING while any instance that is not draining
answers. Real head (in-process grpc.aio), real aiohttp instances on loopback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from grpc_health.v1 import health_pb2

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.server.fleet._server_instances import InstanceTarget, watched
from gym_rpc.wire import InstanceOrigin, InstanceReport, StatusReport
from tests.support.cli import running_head, threaded_http_server
from tests.support.documents import document, server_entry
from tests.support.heads import authority, health_of, read_until, rewrite_config, wait_for_report, watching
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.metrics import METRICS_PATTERN, announced, scrape_until, value, write_config
from tests.support.servers import CountingServer, start_stoppable_server

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def replicated(port: int, *replica_ports: int, **extra: Any) -> dict[str, Any]:
    """A `policy` entry at `port` with static replicas at `replica_ports`, all on loopback."""
    replicas = [{"host": LOOPBACK, "port": p} for p in replica_ports]
    return document({"policy": server_entry(port, replicas=replicas)}, **extra)


def statuses(report: StatusReport) -> list[tuple[str, str | None]]:
    return [(i.instance_id, i.status) for i in report.instances]


async def test_static_replicas_are_instances_each_probed_on_its_own(head_factory, http_server) -> None:
    first, second, dead = await http_server(), await http_server(), closed_port()
    head = await head_factory(replicated(first, second, dead))
    report = await wait_for_report(head, lambda r: all(i.status for i in r.instances), "all probed")
    assert statuses(report) == [
        (authority(first), "success"),
        (authority(second), "success"),
        (authority(dead), "connection_error"),
    ]
    assert [(i.url, i.origin, i.registration) for i in report.instances] == [
        (f"http://{authority(first)}", "config", None),
        (f"http://{authority(second)}", "static_replica", None),
        (f"http://{authority(dead)}", "static_replica", None),
    ]
    assert (report.status, report.url) == ("success", f"http://{authority(first)}")  # the config instance's URL

    client = ControlClient(head.address)
    (listed,) = (await client.list_server_statuses()).reports
    assert watched(listed) == watched(report)  # the wire carries them whole
    rows = [row for row in await client.list_server_instances() if row.name == "policy"]
    assert [(row.instance_id, row.origin, row.status, row.url) for row in rows] == [
        (authority(first), "config", "success", f"http://{authority(first)}"),
        (authority(second), "static_replica", "success", f"http://{authority(second)}"),
        (authority(dead), "static_replica", "connection_error", f"http://{authority(dead)}"),
    ]


async def test_a_server_of_one_instance_reports_exactly_that_instance(head_factory, http_server) -> None:
    port = await http_server()
    head = await head_factory(document({"policy": server_entry(port)}))
    report = await wait_for_report(head, lambda r: r.status is not None, "probed")
    (instance,) = report.instances
    assert (instance.instance_id, instance.origin, instance.url) == (authority(port), "config", report.url)
    assert (report.status, report.latency_seconds, report.checked_at, report.http_status) == (
        instance.status,
        instance.latency_seconds,
        instance.checked_at,
        instance.http_status,
    )


async def test_the_name_is_up_while_any_instance_answers(head_factory) -> None:
    """The config instance is down, a replica answers: the report says SUCCESS (from the replica) and health
    SERVING; once the replica stops too, the config instance's status and NOT_SERVING."""
    runner, replica = await start_stoppable_server()
    config_port = closed_port()
    try:
        head = await head_factory(replicated(config_port, replica))
        report = await wait_for_report(head, lambda r: all(i.status for i in r.instances), "all probed")
        assert statuses(report) == [(authority(config_port), "connection_error"), (authority(replica), "success")]
        assert (report.status, report.url, report.detail) == ("success", f"http://{authority(config_port)}", "")
        assert await health_of(head, "policy") == _SERVING
    finally:
        await runner.cleanup()
    report = await wait_for_report(head, lambda r: r.status == "connection_error", "down")
    assert statuses(report) == [
        (authority(config_port), "connection_error"),
        (authority(replica), "connection_error"),
    ]
    assert await health_of(head, "policy") == _NOT_SERVING


async def test_each_instance_change_is_one_revision_and_a_resume_replays_it(head_factory, http_server) -> None:
    runner, replica = await start_stoppable_server()
    config_port = await http_server()
    try:
        head = await head_factory(replicated(config_port, replica))
        await wait_for_report(head, lambda r: all(i.status == "success" for i in r.instances), "all up")
        client = ControlClient(head.address)
        before = head.prober.revision
        async with watching(client, heartbeat_seconds=0.2) as events:
            (snapshot,) = await read_until(events, lambda e: e.kind == "snapshot")
            assert snapshot.revision == before
            await runner.cleanup()  # the replica goes down: its instance's status changes, and only that
            seen = await read_until(events, lambda e: e.kind == "change")
        change = seen[-1]
        assert change.revision == before + 1
        (changed,) = change.reports
        assert statuses(changed) == [(authority(config_port), "success"), (authority(replica), "connection_error")]
        assert changed.status == "success"  # the name stays up: its config instance answers
        async with watching(client, before, heartbeat_seconds=0.2) as resumed:  # resume from before the change
            replayed = (await read_until(resumed, lambda e: e.kind == "change"))[-1]
        assert (replayed.revision, replayed.reports) == (change.revision, change.reports)
    finally:
        await runner.cleanup()


async def test_a_reload_that_adds_a_replica_is_one_change_and_only_it_is_probed(head_factory, caplog) -> None:
    """GetServerStatus with a freshness bound probes only the instances whose results are too old: the replica a
    reload added, not the two probed a moment ago (probes are single-flight and fresh per instance)."""
    counters = [CountingServer() for _ in range(3)]
    runners = []
    ports = []
    for counter in counters:
        runner = web.AppRunner(counter.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, LOOPBACK, 0).start()
        runners.append(runner)
        ports.append(int(runner.addresses[0][1]))
    try:
        head = await head_factory(replicated(ports[0], ports[1]), probe_interval_seconds=3600)
        await wait_for_report(head, lambda r: all(i.status for i in r.instances), "probed")
        revision = head.prober.revision
        rewrite_config(head, replicated(ports[0], ports[1], ports[2]))
        client = ControlClient(head.address)
        with caplog.at_level(logging.INFO, logger="gym_rpc.head"):
            assert (await client.reload_global_config())[1] is True
        (reloaded,) = [r.getMessage() for r in caplog.records if "config reloaded" in r.getMessage()]
        assert reloaded.endswith(f"(instances of policy: +{authority(ports[2])})")
        added = head.prober.report("policy")
        assert statuses(added) == [  # the new one unprobed; the others keep their results
            (authority(ports[0]), "success"),
            (authority(ports[1]), "success"),
            (authority(ports[2]), None),
        ]
        assert head.prober.revision == revision + 2  # the instance set changed, the config version moved
        reports = await asyncio.gather(
            *(client.get_server_status("policy", max_age_seconds=60) for _ in range(20))
        )
        assert {tuple(statuses(r)) for r in reports} == {
            ((authority(ports[0]), "success"), (authority(ports[1]), "success"), (authority(ports[2]), "success"))
        }
        assert [c.requests for c in counters] == [1, 1, 1]  # the background round's two, then one for 20 callers
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_status_change_of_one_of_several_instances_is_logged_naming_it(head_factory, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gym_rpc.head")
    runner, replica = await start_stoppable_server()
    config_port = closed_port()
    try:
        head = await head_factory(replicated(config_port, replica))
        await wait_for_report(head, lambda r: r.instances[1].status == "success", "replica up")
    finally:
        await runner.cleanup()
    await wait_for_report(head, lambda r: r.instances[1].status == "connection_error", "replica down")
    lines = [r.getMessage() for r in caplog.records if r.name == "gym_rpc.head" and "->" in r.getMessage()]
    config_instance = f"policy {authority(config_port)}: "
    (config_line,) = [line for line in lines[:2] if line.startswith(config_instance)]
    assert config_line.startswith(f"{config_instance}pending -> connection_error on the first probe (")
    assert f"policy {authority(replica)}: pending -> success on the first probe" in lines[:2]
    assert lines[2].startswith(f"policy {authority(replica)}: success -> connection_error after 1 probes (")
    assert len(lines) == 3


async def test_a_draining_instance_gets_no_new_work_so_it_does_not_make_the_name_up(head_factory, http_server):
    """The registry marks an instance draining (a registration that says so): it is still probed and reported,
    but neither the report's SUCCESS nor the health service's SERVING comes from it."""
    first, second = await http_server(), await http_server()
    head = await head_factory(replicated(first, second))
    await wait_for_report(head, lambda r: all(i.status == "success" for i in r.instances), "all up")

    origins: tuple[InstanceOrigin, ...] = ("config", "static_replica")

    async def drain(*draining: bool) -> None:
        await head.prober.set_instances(
            "policy",
            [
                InstanceTarget(
                    InstanceReport(authority(port), f"http://{authority(port)}", origin=origin, draining=flag)
                )
                for port, origin, flag in zip((first, second), origins, draining, strict=True)
            ],
        )

    revision = head.prober.revision
    await drain(True, False)
    report = head.prober.report("policy")
    assert [i.draining for i in report.instances] == [True, False]
    assert head.prober.revision == revision + 1  # draining is a change of the instance: one revision
    assert report.status == "success" and await health_of(head, "policy") == _SERVING  # the other one answers
    await drain(True, True)
    report = head.prober.report("policy")
    # Both answer, but no instance may be given new work: the status says so, as health and clients do (issue 43).
    assert report.status == "unknown_error" and "every instance is draining" in report.detail
    assert await health_of(head, "policy") == _NOT_SERVING


def test_the_heads_metrics_count_instances_by_state(tmp_path) -> None:
    """`gym_server_instances` by state, from a real `gym-rpc head`."""
    with threaded_http_server() as server:
        dead = closed_port()
        replicas = [f"{LOOPBACK}:{dead}"]
        config = write_config(tmp_path / "gym.yaml", {"policy": server_entry(server.port, replicas=replicas)})
        with running_head(config, "--metrics-port", "0") as head:
            url = announced(head, METRICS_PATTERN)
            samples = scrape_until(
                url,
                lambda s: value(s, "gym_server_instances", gym_instance_state="pending") == 0.0,
                "both instances probed",
            )
            counts = {
                state: value(samples, "gym_server_instances", gym_server_name="policy", gym_instance_state=state)
                for state in ("up", "draining", "down", "pending")
            }
            assert counts == {"up": 1.0, "draining": 0.0, "down": 1.0, "pending": 0.0}
            assert f":{dead}" not in str(samples)  # no addresses in metrics
            assert value(samples, "gym_server_up", gym_server_name="policy") == 1.0  # the name is up
