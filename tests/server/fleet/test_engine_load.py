"""Load from the engines (issue 39 point 3): the head reads each engine instance's `/metrics` (vLLM's and SGLang's
names) for entries with `session_affinity_header`, shows it in ListServerStatuses and `gym-rpc status`, and
pushes it down watches that ask, coalesced; a figure older than the bound is unknown, never zero; clients get it
through `ServerClient.engine_loads` (and the routes' `engine_loads` table a picker reads). Real aiohttp engines,
a real head."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from gym_rpc._tasks import stop_poller
from gym_rpc.client._follower import close_instance_followers
from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.replicas._engine_load_table import EngineLoadTable
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig, GlobalConfig, ServerEntry
from gym_rpc.errors import ConfigError
from gym_rpc.server import HeadServer
from gym_rpc.server.fleet._engine_load import (
    PUSH_INTERVAL_SECONDS,
    EngineLoads,
    EngineTarget,
    LoadPush,
    parse_engine_metrics,
)
from gym_rpc.wire import EngineLoad
from tests.support.cli import run_cli
from tests.support.documents import document, server_entry
from tests.support.engines import SGLANG_METRICS, VLLM_METRICS, FakeEngine, engine_entry, engines_head
from tests.support.loopback import LOOPBACK
from tests.support.waiting import eventually

WAIT_SECONDS = 15.0  # a read every 0.5 s: this bounds a wait for one on a loaded machine


# --- reading /metrics --------------------------------------------------------------------------------------------


def test_vllm_names_with_labels_help_and_several_ranks() -> None:
    text = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m a {b}"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m a {b}"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 4.0 1712345678000
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:prompt_tokens_total{model_name="m"} 12345.0
"""
    # counts add up over ranks, cache use averages; other series are not read
    assert parse_engine_metrics(text) == {"waiting": 3.0, "running": 4.0, "kv_cache_usage": 0.375}


def test_sglang_names() -> None:
    text = 'sglang:num_queue_reqs{model_name="m"} 7\nsglang:num_running_reqs 2\nsglang:token_usage 0.9\n'
    assert parse_engine_metrics(text) == {"waiting": 7.0, "running": 2.0, "kv_cache_usage": 0.9}


def test_what_is_not_a_finite_number_stays_unknown_never_zero() -> None:
    lines = ["vllm:num_requests_waiting NaN", "vllm:num_requests_running +Inf", "vllm:kv_cache_usage_perc x"]
    text = "\n".join([*lines, "vllm:num_requests_waiting", ""])
    assert parse_engine_metrics(text) == {}
    assert parse_engine_metrics("") == {}


async def test_a_figure_older_than_the_bound_is_unknown_and_a_failing_engine_ages_into_it(http_server) -> None:
    engine = FakeEngine("e", dict(VLLM_METRICS))
    port = await http_server(engine.app())
    now = [100.0]
    loads = EngineLoads(
        lambda: [EngineTarget("policy", f"{LOOPBACK}:{port}", f"http://{LOOPBACK}:{port}")],
        max_age_seconds=5.0,
        clock=lambda: now[0],
    )
    try:
        assert loads.loads() == []  # nothing read yet
        await loads.read_all()
        [fresh] = loads.loads()
        assert (fresh.waiting, fresh.running, fresh.kv_cache_usage, fresh.age_seconds) == (3, 5, 0.42, 0.0)
        version = loads.version
        engine.metrics = {}  # an engine that stops answering /metrics with its figures
        now[0] += 4.0
        await loads.read_all()  # read: no figures at all now
        [empty] = loads.loads()
        assert (empty.waiting, empty.running, empty.kv_cache_usage) == (None, None, None)
        assert loads.version == version + 1
        engine.metrics = dict(VLLM_METRICS)
        await loads.read_all()
        now[0] += 5.5
        [stale] = loads.loads()  # read 5.5 s ago: past the bound
        assert (stale.waiting, stale.running, stale.kv_cache_usage, stale.age_seconds) == (None, None, None, 5.5)
    finally:
        await loads.stop()


async def test_an_engine_that_is_gone_keeps_its_figures_only_until_the_bound(http_server) -> None:
    engine = FakeEngine("e", dict(VLLM_METRICS))
    now = [0.0]
    port = await http_server(engine.app())
    targets = [
        EngineTarget("policy", "gone", "http://127.0.0.1:1"),
        EngineTarget("policy", "up", f"http://{LOOPBACK}:{port}"),
    ]
    loads = EngineLoads(lambda: targets, max_age_seconds=5.0, clock=lambda: now[0], timeout_seconds=2.0)
    try:
        await loads.read_all()
        gone, up = loads.loads()
        assert (gone.instance_id, gone.waiting, gone.age_seconds) == ("gone", None, None)  # never read
        assert (up.instance_id, up.waiting) == ("up", 3)
    finally:
        await loads.stop()


async def test_stopped_loads_read_again_over_a_new_session(http_server) -> None:
    """`stop` ends the reads and closes their session (gym_rpc._tasks.stop_poller) and forgets it: loads read again
    afterwards open a new one instead of failing on the closed one."""
    port = await http_server(FakeEngine("e", dict(VLLM_METRICS)).app())
    loads = EngineLoads(lambda: [EngineTarget("policy", "up", f"http://{LOOPBACK}:{port}")], max_age_seconds=5.0)
    try:
        await loads.read_all()
        await loads.stop()
        version = loads.version
        await loads.read_all()
        assert loads.version == version + 1  # a round that read figures (over a closed session it would read none)
    finally:
        await loads.stop()


async def test_a_poller_ends_before_the_session_it_reads_over_closes() -> None:
    """gym_rpc._tasks.stop_poller: the task is cancelled and has ended before its session is closed, so the task
    never meets a closed session (nor opens one anew) while it ends."""
    session = aiohttp.ClientSession()
    seen: list[bool] = []

    async def poll() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            seen.append(session.closed)

    task = asyncio.create_task(poll())
    await asyncio.sleep(0)  # the task is waiting in its sleep
    await stop_poller(task, session)
    assert (seen, task.cancelled(), session.closed) == ([False], True, True)
    await stop_poller(None, None)  # nothing started: nothing to end


# --- the head ----------------------------------------------------------------------------------------------------


def figures(loads: list[EngineLoad]) -> dict[str, tuple[float | None, float | None, float | None]]:
    return {load.instance_id: (load.waiting, load.running, load.kv_cache_usage) for load in loads}


async def test_list_server_statuses_carries_each_engine_instances_load(head_factory, http_server) -> None:
    head, engines = await engines_head(head_factory, http_server)
    client = ControlClient(f"{LOOPBACK}:{head.port}")
    instances = [instance.instance_id for instance in head.config.servers["policy"].instances]

    async def read() -> list[EngineLoad]:
        return (await client.list_server_statuses()).engine_loads

    loads = await eventually(
        read,
        lambda loads: bool(loads) and all(load.age_seconds is not None for load in loads),
        within=WAIT_SECONDS,
        what="read of both engines",
    )
    assert {load.server_name for load in loads} == {"policy"}  # the Gym server's /metrics is never read
    assert figures(loads) == {instances[0]: (3, 5, 0.42), instances[1]: (7, 2, 0.9)}
    assert all(0 <= (load.age_seconds or 0) <= 5 for load in loads)
    assert engines[0].scrapes >= 1 and engines[1].scrapes >= 1


def test_engine_metrics_false_turns_the_reads_off_and_takes_booleans_only() -> None:
    def entry_of(**keys: Any) -> ServerEntry:
        return GlobalConfig.from_document(document({"policy": engine_entry(8000, **keys)})).servers["policy"]

    assert entry_of().engine_metrics is True
    assert entry_of(engine_metrics=None).engine_metrics is True
    assert entry_of(engine_metrics=False).engine_metrics is False
    with pytest.raises(ConfigError, match="server 'policy': engine_metrics must be true or false, not str 'no'"):
        entry_of(engine_metrics="no")


async def test_only_engine_entries_are_read_registered_instances_included(head_factory, http_server) -> None:
    """A router marked `engine_metrics: false` is not read (vllm-router passes /metrics on to one of its engines);
    an engine instance that registers with the head is read as the config's are."""
    engine, router, registering = FakeEngine("e", dict(VLLM_METRICS)), FakeEngine("r"), FakeEngine("g")
    engine_port, router_port = await http_server(engine.app()), await http_server(router.app())
    registering.metrics = dict(SGLANG_METRICS)
    registering_port = await http_server(registering.app())
    doc = document(
        {"policy": engine_entry(engine_port), "router": engine_entry(router_port, engine_metrics=False)}
    )
    head = await head_factory(doc)
    client = ControlClient(f"{LOOPBACK}:{head.port}")
    await client.register_server_instance("policy", listen_port=registering_port, listen_host=LOOPBACK, pid=4242)

    async def read() -> list[EngineLoad]:
        return (await client.list_server_statuses()).engine_loads

    loads = await eventually(
        read,
        lambda loads: len(loads) == 2 and all(load.waiting is not None for load in loads),
        within=WAIT_SECONDS,
        what="read of the config's engine and the registered one",
    )
    assert figures(loads) == {
        f"{LOOPBACK}:{engine_port}": (3, 5, 0.42),
        f"{LOOPBACK}:{registering_port}": (7, 2, 0.9),
    }
    assert router.scrapes == 0


async def test_a_config_without_engines_reads_nothing(head_factory, http_server) -> None:
    engine = FakeEngine("gym", dict(VLLM_METRICS))
    head = await head_factory(document({"policy": engine_entry(await http_server(engine.app()), None)}))
    await asyncio.sleep(1.2)  # past two read intervals
    assert (await ControlClient(f"{LOOPBACK}:{head.port}").list_server_statuses()).engine_loads == []
    assert engine.scrapes == 0 and head.engine_loads.reads == 0


async def test_watches_that_ask_get_the_load_coalesced_and_others_never(head_factory, http_server) -> None:
    head, _ = await engines_head(head_factory, http_server)
    client = ControlClient(f"{LOOPBACK}:{head.port}")

    async def events(engine_load: bool, seconds: float) -> list[Any]:
        seen = []
        stream = client.watch_server_statuses(0, heartbeat_seconds=0.5, engine_load=engine_load, timeout=seconds)
        try:
            async for event in stream:
                seen.append((time.monotonic(), event))
        except Exception:  # the stream's deadline ends it
            pass
        return seen

    asking, plain = await asyncio.gather(events(True, 3.0), events(False, 3.0))
    pushed = [(at, event) for at, event in asking if event.kind == "engine_load"]
    assert len(pushed) >= 2  # a read every 0.5 s: news several times in 3 s
    assert len(pushed) <= 3.0 / PUSH_INTERVAL_SECONDS + 1  # coalesced: never more than one per push interval
    last = pushed[-1][1]
    assert last.revision == asking[0][1].revision  # no revision of its own
    assert figures(last.engine_loads)[f"{LOOPBACK}:{engines_port(head, 1)}"] == (7, 2, 0.9)
    assert [event.kind for _, event in plain if event.kind == "engine_load"] == []
    assert {event.kind for _, event in plain} <= {"snapshot", "change", "heartbeat"}


def test_one_watchers_pushes_are_coalesced_to_the_latest_table() -> None:
    """LoadPush: news goes out at most once per push interval, as the latest table (never a backlog), and a
    heartbeat only when the watcher has been sent nothing for a heartbeat interval. Without engines a watch
    waits as it always did."""
    now = [0.0]
    reads = EngineLoads(lambda: [], clock=lambda: now[0])
    push = LoadPush(reads, clock=lambda: now[0])
    assert not push.due()  # nothing read yet: nothing to send
    assert push.wait_seconds(5.0) == 5.0  # no engine read: the heartbeat's wait, no more wake-ups
    reads._order = [("policy", "a:1")]  # a round read one engine
    reads.version = 1
    assert push.wait_seconds(5.0) == PUSH_INTERVAL_SECONDS and push.wait_seconds(0.1) == 0.1
    assert push.due() and not push.due()  # the table once, then no news
    reads.version += 3  # three read rounds before the watcher looks again: one message
    assert not push.due()  # but not within the push interval
    now[0] += PUSH_INTERVAL_SECONDS
    assert push.due() and not push.due()
    assert not push.heartbeat_due(5.0)
    now[0] += 5.0
    assert push.heartbeat_due(5.0) and not push.heartbeat_due(5.0)


async def test_a_head_without_engines_sends_a_watch_that_asks_no_load_and_wakes_it_no_more(
    head_factory, http_server
) -> None:
    head = await head_factory(document({"judge": server_entry(await http_server(), "resources_servers")}))
    client = ControlClient(f"{LOOPBACK}:{head.port}")
    seen = []
    stream = client.watch_server_statuses(0, heartbeat_seconds=1.0, engine_load=True, timeout=2.5)
    try:
        async for event in stream:
            seen.append(event.kind)
    except Exception:  # the stream's deadline ends it
        pass
    assert "engine_load" not in seen
    assert seen.count("heartbeat") <= 3  # one a second, not one per push interval


def engines_port(head: HeadServer, index: int) -> int:
    return head.config.servers["policy"].instances[index].port


async def test_a_client_following_the_head_knows_each_engines_load_and_its_changes(
    head_factory, http_server
) -> None:
    head, engines = await engines_head(head_factory, http_server)
    client = ServerClient._from_global_config(BaseServerConfig(host=LOOPBACK, port=head.port), head.config)
    try:
        ids = [instance.instance_id for instance in head.config.servers["policy"].instances]

        loads = await eventually(
            lambda: client.engine_loads("policy"),
            lambda loads: len(loads) == 2,
            within=WAIT_SECONDS,
            what="load pushed to the client",
        )
        assert figures(list(loads.values())) == {ids[0]: (3, 5, 0.42), ids[1]: (7, 2, 0.9)}
        engines[0].metrics["vllm:num_requests_waiting"] = 40

        async def changed() -> bool:
            return client.engine_loads("policy")[ids[0]].waiting == 40

        await eventually(changed, within=WAIT_SECONDS, what="the new queue length")
        assert client.engine_loads("judge") == {}
        with pytest.raises(KeyError):
            client.engine_loads("nope")
    finally:
        close_instance_followers()
        await close_http_sessions()


def test_the_clients_table_takes_ages_on_its_own_clock_and_forgets_what_is_stale() -> None:
    now = [50.0]
    table = EngineLoadTable(max_age_seconds=5.0, clock=lambda: now[0])
    table.apply(
        [
            EngineLoad("policy", "a:1", 1.0, 2.0, 0.5, age_seconds=1.0),
            EngineLoad("policy", "b:1", None, 3.0, None, age_seconds=0.0),
            EngineLoad("policy", "c:1", 9.0, 9.0, 0.9, age_seconds=None),  # never read by the head
        ]
    )
    assert table.of("policy", "a:1") == EngineLoad("policy", "a:1", 1.0, 2.0, 0.5, 1.0)
    assert table.of("policy", "b:1") == EngineLoad("policy", "b:1", None, 3.0, None, 0.0)
    assert table.of("policy", "c:1") is None and table.of("other", "a:1") is None
    now[0] += 4.5  # a: 5.5 s old, b: 4.5 s
    assert table.of("policy", "a:1") is None
    assert set(table.server("policy")) == {"b:1"}
    table.apply([])  # the head reads no engine any more
    assert table.server("policy") == {}


# --- gym-rpc status ----------------------------------------------------------------------------------------------


@pytest.mark.process
async def test_gym_rpc_status_shows_each_engines_queue_and_cache_use(head_factory, http_server) -> None:
    head, _ = await engines_head(head_factory, http_server)
    address = f"{LOOPBACK}:{head.port}"
    client = ControlClient(address)

    async def read() -> bool:
        loads = (await client.list_server_statuses()).engine_loads
        return len(loads) == 2 and all(load.waiting is not None for load in loads)

    await eventually(read, within=WAIT_SECONDS, what="read of both engines")
    table, as_json = await asyncio.gather(
        asyncio.to_thread(run_cli, ["status", "--head", address], timeout=60),
        asyncio.to_thread(run_cli, ["status", "--head", address, "-o", "json"], timeout=60),
    )
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.rstrip().endswith("ENGINE LOAD")
    assert any(line.rstrip().endswith("3 waiting, 5 running, kv 42%") for line in lines)
    assert any(line.rstrip().endswith("7 waiting, 2 running, kv 90%") for line in lines)
    assert as_json.returncode == 0, as_json.stderr
    rows = {row["name"]: row for row in json.loads(as_json.stdout)}
    policy = [instance["engine_load"] for instance in rows["policy"]["instances"]]
    assert [(load["waiting"], load["running"], load["kv_cache_usage"]) for load in policy] == [
        (3, 5, 0.42),
        (7, 2, 0.9),
    ]
    assert all(0 <= load["age_seconds"] <= 5 for load in policy)
    assert rows["judge"]["instances"][0]["engine_load"] is None
