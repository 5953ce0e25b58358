"""Replicas as real processes behind a real head: one killed with `kill -9` mid-run costs no call of no rollout,
moves only its own rollouts, and gets no call once its death is known; a replica added while calls run gets
calls within a second or so; one given SIGTERM drains (no new work, its pinned rollouts finish there). Bounds
are generous (a loaded 2-core machine); bench/replicas.py measures the same things tightly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import orjson
import pytest

from bench.servers import ServerProcess
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.data._rollout import rollout_context
from gym_rpc.client.replicas._instance_state import Instance
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig
from tests.support.documents import document, server_entry
from tests.support.heads import rewrite_config
from tests.support.loopback import LOOPBACK
from tests.support.processes import AIOHTTP_SERVER, replica  # noqa: F401 (replica: a fixture)
from tests.support.waiting import eventually

NAME = "policy"
CALLS = 800


class Replicas:
    """Replica processes (`python -m bench.servers replica`) shared by this module's tests: started once, at once;
    `take(n)` hands out the first n, each started again (on its port) if a test killed it."""

    def __init__(self, count: int) -> None:
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            self.processes = list(pool.map(lambda _: ServerProcess("replica", *REPLICA_ARGS), range(count)))

    def take(self, count: int) -> list[ServerProcess]:
        for index, process in enumerate(self.processes[:count]):
            if process.process.poll() is not None:
                self.processes[index] = ServerProcess(
                    "replica", *REPLICA_ARGS, "--port", str(process.info["port"])
                )
        return self.processes[:count]

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


REPLICA_ARGS = ("--delay-ms", "1")


@pytest.fixture(scope="module")
def replica_pool() -> Iterator[Replicas]:
    pool = Replicas(5)
    yield pool
    pool.stop()


@pytest.fixture
async def replica_processes(replica_pool: Replicas) -> Callable[[int], Awaitable[list[ServerProcess]]]:
    async def take(count: int) -> list[ServerProcess]:
        return await asyncio.to_thread(replica_pool.take, count)

    return take


def config(ports: list[int], server_type: str = "responses_api_models") -> dict[str, Any]:
    replicas = [f"{LOOPBACK}:{port}" for port in ports[1:]]
    return document({NAME: server_entry(ports[0], server_type, replicas=replicas)})


async def behind_a_head(
    replica_processes: Callable[[int], Awaitable[list[ServerProcess]]],
    head_factory: Any,
    count: int,
    listed: int,
    server_type: str = "responses_api_models",
) -> tuple[list[ServerProcess], list[int], Any, ServerClient]:
    """`count` replica processes, a head whose config lists the first `listed` as a server of `server_type`, and a
    client of it (one call made, so it follows the head)."""
    processes = await replica_processes(count)
    ports = [int(process.info["port"]) for process in processes]
    head = await head_factory(config(ports[:listed], server_type), probe_interval_seconds=0.2)
    head_server = BaseServerConfig(host=LOOPBACK, port=head.port)
    client = await asyncio.to_thread(ServerClient.load_from_global_config, head_server)
    await call(client)
    return processes, ports, head, client


async def call(client: ServerClient) -> int:
    """A call of no rollout and no prompt (gym_rpc.client.replicas._prompt_key reads none in this body): two random
    choices, on a model server too."""
    async with await client.post(NAME, "/v1/responses", json={"query": "hi"}) as response:
        return int(orjson.loads(await response.read())["instance"])


class DeathWatch:
    """Samples an instance every millisecond: its picks when it was first seen not alive (known dead)."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.known_at: float | None = None
        self.picks_when_known = 0
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while self.known_at is None:
            if not self.instance.alive:
                self.known_at, self.picks_when_known = time.monotonic(), self.instance.picks
                return
            await asyncio.sleep(0.001)

    def stop(self) -> None:
        self._task.cancel()


@pytest.fixture
async def closing() -> AsyncIterator[None]:
    yield
    await close_http_sessions()


async def run_calls(
    calls: int, concurrency: int, one: Callable[[int], Any], when_done: Callable[[int], None]
) -> list[BaseException]:
    """`calls` calls by `concurrency` workers; `when_done(done)` after each; the errors of the failed ones."""
    numbers = itertools.count()
    done = [0]
    failures: list[BaseException] = []

    async def worker() -> None:
        while (number := next(numbers)) < calls:
            try:
                await one(number)
            except Exception as error:
                failures.append(error)
            done[0] += 1
            when_done(done[0])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failures


async def test_kill_9_of_one_of_four_replicas_costs_no_call_of_no_rollout(
    replica_processes, head_factory, closing
) -> None:
    processes, ports, _, client = await behind_a_head(replica_processes, head_factory, 4, 4)
    assert client._routing is not None
    dead = client._routing.routes[NAME].by_id[f"{LOOPBACK}:{ports[0]}"]
    watch = DeathWatch(dead)
    killed_at = [0.0]

    def kill_a_quarter_in(done: int) -> None:
        if done == CALLS // 4:
            killed_at[0] = time.monotonic()
            os.kill(processes[0].pid, signal.SIGKILL)

    try:
        failures = await run_calls(CALLS, 16, lambda _: call(client), kill_a_quarter_in)
    finally:
        watch.stop()
    assert failures == []
    assert watch.known_at is not None and watch.known_at - killed_at[0] < 5.0  # bench: tens of ms
    assert dead.picks == watch.picks_when_known  # no call went to it once its death was known


async def test_kill_9_during_rollouts_moves_only_the_dead_replicas_rollouts(
    replica_processes, head_factory, closing
) -> None:
    """A resources server's rollouts stick to their instance exactly (its state lives there): a kill -9 moves only
    the dead replica's. A model server's rollouts may also leave an instance that is slow or overloaded, which a
    loaded machine makes happen (soak run 6: rollouts of live replicas moved), so this is the resources rule."""
    processes, ports, _, client = await behind_a_head(replica_processes, head_factory, 4, 4, "resources_servers")
    paths: dict[int, list[int]] = {}
    per_rollout = 5

    async def one_rollout(number: int) -> None:
        in_flight.add(number)
        with rollout_context(f"rollout-{number}"):
            for _ in range(per_rollout):
                paths.setdefault(number, []).append(await call(client))
        in_flight.discard(number)

    in_flight: set[int] = set()
    killed: list[int] = []

    def kill_once(done: int) -> None:
        """From 60 rollouts on, kill the replica of a rollout in flight that has answered calls and has two or more
        to make: which replicas the rollouts in flight stick to depends on the ports, so a fixed victim sometimes
        had none of them. The victim's call in flight may still be answered (its reply can be in the socket before
        the kill), so only a second call is sure to find the replica dead; the wait for the death itself (a few ms,
        the loop held) makes that second call come after it."""
        started = [number for number in in_flight if 0 < len(paths.get(number, ())) <= per_rollout - 2]
        if done >= 60 and not killed and started:
            port = paths[started[0]][-1]
            victim = processes[ports.index(port)].process
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=10)
            killed.append(port)

    failures = await run_calls(CALLS // per_rollout, 16, one_rollout, kill_once)
    assert failures == []
    assert killed, "no rollout in flight had answered a call"
    dead = killed[0]
    moved = {number for number, seen in paths.items() if len(set(seen)) > 1}
    assert moved and all(paths[number][0] == dead for number in moved)  # only the dead replica's rollouts moved
    for number in moved:  # ... each once, and never back
        seen = paths[number]
        first_elsewhere = next(index for index, port in enumerate(seen) if port != dead)
        assert len(set(seen[first_elsewhere:])) == 1 and dead not in seen[first_elsewhere:]


async def test_a_replica_added_while_calls_run_gets_calls_within_a_second_or_so(
    replica_processes, head_factory, closing
) -> None:
    _, ports, head, client = await behind_a_head(replica_processes, head_factory, 5, 4)
    first_answer: dict[int, float] = {}
    stop, fifth_answered = asyncio.Event(), asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            port = await call(client)
            first_answer.setdefault(port, time.monotonic())
            if port == ports[4]:
                fifth_answered.set()

    workers = [asyncio.create_task(worker()) for _ in range(8)]
    try:
        rewrite_config(head, config(ports))  # a fifth replica in the config: one change of the server
        added_at = time.monotonic()
        assert await head.reload()
        await asyncio.wait_for(fifth_answered.wait(), 10)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert ports[4] in first_answer and first_answer[ports[4]] - added_at < 5.0  # bench: well under a second


async def test_sigterm_drains_a_registered_replica_new_work_leaves_it_and_its_pinned_rollouts_finish_there(
    replica,  # noqa: F811 (tests.test_draining's fixture)
    closing,
    slowness_rule_off,  # a model server: the rollouts pinned to the draining process must not leave it as slow
) -> None:
    """A registered server process gets SIGTERM (integrations' draining) while a call of one of its rollouts is
    in flight: the client learns from the head's watch that it drains; then no new rollout and no call of no
    rollout goes there, while every rollout pinned there still calls it and is answered; once its call is done
    it deregisters and exits, and its rollouts move (a rollout pinned to a gone instance is pinned again)."""
    head, server = await replica(AIOHTTP_SERVER, grace=20.0)
    client = await asyncio.to_thread(
        ServerClient.load_from_global_config, BaseServerConfig(host=LOOPBACK, port=head.port)
    )

    async def port_of(rollout: str | None, seconds: float = 0.0) -> int:
        with rollout_context(rollout):
            async with await client.get(NAME, f"/work?seconds={seconds}") as response:
                await response.read()
                assert response.status == 200
                return int(response.url.port or 0)

    await port_of(None)
    assert client._routing is not None
    route = client._routing.routes[NAME]
    draining = route.by_id[f"{LOOPBACK}:{server.port}"]
    pinned = {f"before-{n}": await port_of(f"before-{n}") for n in range(30)}
    on_it = [rollout for rollout, port in pinned.items() if port == server.port]
    assert on_it and len(on_it) < len(pinned)  # rendezvous spread them over both instances
    held = asyncio.create_task(port_of(on_it[0], seconds=6.0))  # keeps it draining (the helper waits for it)
    await eventually(lambda: draining.in_flight == 1, within=10, every=0.01)

    server.process.send_signal(signal.SIGTERM)
    await eventually(lambda: draining.draining, within=10, every=0.01)
    assert not held.done()
    fresh = [await port_of(f"after-{n}") for n in range(30)] + [await port_of(None) for _ in range(30)]
    assert server.port not in fresh  # no new work
    assert [await port_of(rollout) for rollout in on_it] == [server.port] * len(on_it)  # they finish there
    assert not held.done()  # all of that while it drained

    assert await held == server.port  # its call in flight finished
    assert await asyncio.wait_for(server.process.wait(), 30) in (0, -signal.SIGTERM)
    await eventually(lambda: draining.instance_id not in route.by_id, within=10, every=0.01)
    moved = [await port_of(rollout) for rollout in on_it]
    assert server.port not in moved and route.repins == len(on_it)
