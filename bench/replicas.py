"""Replicas: `ServerClient` spreading calls over several instances of one server, each row against what a user
does today, measured in the same run.

* `replicas-pick`: picking among 64 instances with no I/O (two random choices for calls of no rollout; rollouts
  of 8 calls, the first of which pins), against `next(itertools.cycle(urls))`, interleaved blocks.
* `replicas-slow`: four replicas, one serving 10x slower; ServerClient (two choices by calls in flight) against
  round robin and random picking over the same four URLs with raw aiohttp + orjson, in rotating blocks.
* `replicas-kill`: `kill -9` of one of four replicas a quarter into 20,000 calls: of no rollout (against round
  robin with raw aiohttp, on a fresh set of four), and of rollouts of 8 calls (against what `hash(rollout) % N`
  would move); failed calls, rollouts moved, calls sent to the dead replica after its death was known, and how
  long after the kill that was.
* `replicas-join`: four replicas registered with a `gym-rpc head` subprocess, calls of no rollout running; a fifth
  registers: how long until it answers a call.

Each replica is a process of its own (`python -m bench.servers replica`): it answers `{"instance": <port>}` after
its delay, at most `--slots` calls at once, the rest queued, as a server whose capacity is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
import yaml

from bench.data_plane import JSON_HEADERS, PAYLOAD, raw_session
from bench.servers import LOOPBACK, REPO_ROOT, ServerProcess, terminate, wait_until
from bench.stats import Row, median, percentile
from gym_rpc.client import ServerClient, close_http_sessions, rollout_context
from gym_rpc.client.replicas._call_in_flight import RoutedCall
from gym_rpc.client.replicas._instance_state import Instance, InstanceState
from gym_rpc.client.replicas._outliers import OutlierDetection
from gym_rpc.client.replicas._picker import SLOTS, heaviest, stable_key
from gym_rpc.client.replicas._prompt_key import prompt_key
from gym_rpc.client.replicas._server_route import ServerRoute
from gym_rpc.config import BaseServerConfig, GlobalConfig

NAME = "policy_model"
PATH = "/v1/responses"
REPLICAS_LOGGER = "gym_rpc.client.replicas"
Post = Callable[[], Awaitable[int]]


@dataclass(frozen=True)
class ReplicasPlan:
    pick_instances: int = 64
    pick_calls: int = 20000  # per block
    pick_blocks: int = 15  # per side, interleaved; the best block is the figure
    rollout_calls: int = 8  # calls per rollout (the first pins it)
    slow_delay_ms: float = 4.0  # a fast replica's service time (the slow one's is 10x)
    slow_slots: int = 4  # calls a replica serves at once
    slow_concurrency: int = 64
    slow_block_seconds: float = 2.0
    slow_rounds: int = 3
    kill_calls: int = 20000
    kill_concurrency: int = 64
    kill_delay_ms: float = 1.0
    join_replicas: int = 4
    join_wait_seconds: float = 10.0  # for the replicas to be listed, then for the fifth's first answer


PICK_COUNTS = (4, 16, 64)  # instances of the rollout rows

QUICK_REPLICAS = ReplicasPlan(
    pick_calls=2000,
    pick_blocks=2,
    slow_block_seconds=0.3,
    slow_rounds=1,
    kill_calls=800,
    join_replicas=2,
    join_wait_seconds=5.0,
)


def _absolute_row(area: str, measure: str, ours: str, baseline: str, met: bool, goal: str, ratio: float) -> Row:
    return Row(area, measure, ours, baseline, ratio, goal, met)


def start_replicas(
    count: int, *args: str, slow: int | None = None, slow_delay_ms: float = 0.0
) -> list[ServerProcess]:
    processes = []
    try:
        for index in range(count):
            extra = ["--delay-ms", str(slow_delay_ms)] if index == slow else []
            processes.append(ServerProcess("replica", *args, *extra))
    except BaseException:
        for process in processes:
            process.stop()
        raise
    return processes


# The replicated server of the slow, kill and join rows: a resources server, whose calls of no rollout go by two
# random choices. A model server's calls of one prompt (PAYLOAD, every time) would go by prefix-affine picking,
# which the replicas-pick rows and bench/engines.py measure.
SERVER_TYPE = "resources_servers"


def replicated_client(ports: list[int], **global_keys: Any) -> ServerClient:
    """A client of a config listing the replicas statically (it follows no head)."""
    entry = {"host": LOOPBACK, "port": ports[0], "replicas": [f"{LOOPBACK}:{port}" for port in ports[1:]]}
    doc = {"head_server": {"host": LOOPBACK, "port": 1}, NAME: {SERVER_TYPE: {"bench": entry}}}
    client = ServerClient._from_global_config(
        BaseServerConfig(host=LOOPBACK, port=1), GlobalConfig.from_document({**doc, **global_keys})
    )
    client.follow_instances(False)
    return client


def ours_post(client: ServerClient) -> Post:
    async def post() -> int:
        async with await client.post(NAME, PATH, json=PAYLOAD) as response:
            return int(orjson.loads(await response.read())["instance"])

    return post


def raw_post(session: aiohttp.ClientSession, next_url: Callable[[], str]) -> Post:
    async def post() -> int:
        async with session.post(next_url(), data=orjson.dumps(PAYLOAD), headers=JSON_HEADERS) as response:
            return int(orjson.loads(await response.read())["instance"])

    return post


# --- picking without I/O -----------------------------------------------------------------------------------------


def _us_per_call(calls: int, work: Callable[[int], object]) -> float:
    """µs of this thread's CPU per call: picking does no I/O, so its cost is the CPU it takes. Wall time on a
    machine shared with other work also counts the time slices other processes took (at load 20 on 2 cores, the
    best of 15 blocks read 2-3x the CPU time)."""
    started = time.thread_time()
    for index in range(calls):
        work(index)
    return (time.thread_time() - started) / calls * 1e6


class PlainRendezvousRoute(ServerRoute):
    """The route without its remembered slot winners: every new rollout weighs every candidate (plain rendezvous
    over the candidates), the baseline that shows whether remembering winners pays."""

    __slots__ = ()

    def slot_winner(self, slot: int, candidates: tuple[Instance, ...]) -> Instance:
        return heaviest(slot, candidates)


def _route(kind: type[ServerRoute], count: int, affine: bool = False) -> ServerRoute:
    urls = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(count)]
    states = [InstanceState(url.removeprefix("http://"), url, "success") for url in urls]
    return kind(NAME, states, OutlierDetection(), affine=affine)


AFFINE_PROMPTS = 256  # prompts of the affine rows, each a GRPO group of 8 rollouts


def affine_body(task: int, rollout: int, turn: int) -> dict[str, Any]:
    """A Responses body as a GRPO rollout's turn sends it: a system prompt the run shares (about 1,000
    characters), the task's text, then two items per turn before this one (the model's call, the tool's output)."""
    task_text = f"Task {task}: " + "find the weather in the city named below and report. " * 8
    items: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful agent. Use the tools; think step by step. " * 16},
        {"role": "user", "content": task_text},
    ]
    for step in range(turn):
        call_id = f"c{step}"
        items.append({"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": "{}"})
        items.append({"type": "function_call_output", "call_id": call_id, "output": f"rollout {rollout} #{step}"})
    return {"model": "policy", "input": items}


def affine_sides(plan: ReplicasPlan) -> dict[str, Callable[[int], object]]:
    """A model server's route with no I/O (`affine`): the prompt read from the body
    (gym_rpc.client.replicas._prompt_key), the prefix-affine pick (the rollout's last instance, else its prompt's
    preferred under the load bound), the call counted in flight and its answer heard; among `pick_instances`
    instances, every prompt's preferred instances ranked already (the state a run reaches), GRPO rollouts of
    `rollout_calls` turns, 8 per prompt, new rollout ids in every block. `prompt`: reading the prompt alone."""
    answer: Any = SimpleNamespace(status=200, headers={}, connection=None)  # its body came with it
    per_rollout = plan.rollout_calls
    bodies = [[affine_body(task, 0, turn) for turn in range(per_rollout)] for task in range(AFFINE_PROMPTS)]
    route = _route(ServerRoute, plan.pick_instances, affine=True)
    blocks = itertools.count()
    block = [0]

    def work(index: int, route: ServerRoute = route) -> object:
        if index == 0:
            block[0] = next(blocks)  # each block's rollouts are new ones
        rollout_index, turn = divmod(index, per_rollout)
        task = rollout_index // 8 % AFFINE_PROMPTS
        call = RoutedCall(route, f"{task}-{block[0]}.{rollout_index}", PATH, None, prompt_key(bodies[task][turn]))
        call.answered(answer)
        return call.instance.url + PATH

    def prompt_only(index: int) -> object:
        rollout_index, turn = divmod(index, per_rollout)
        return prompt_key(bodies[rollout_index // 8 % AFFINE_PROMPTS][turn])

    _us_per_call(AFFINE_PROMPTS * 8 * per_rollout, work)  # every prompt's preferred instances ranked
    return {"affine": work, "prompt": prompt_only}


def affine_row(plan: ReplicasPlan, best: dict[str, float]) -> Row:
    return _absolute_row(
        "replicas",
        f"picking among {plan.pick_instances} instances of a model server, prefix-affine: GRPO turns (8 rollouts "
        f"of each of {AFFINE_PROMPTS} prompts, {plan.rollout_calls} turns each, a system prompt of 1,000 "
        f"characters), the prompt read from the body, the pick, the call counted and its answer heard (best of "
        f"{plan.pick_blocks} interleaved blocks of {plan.pick_calls} calls, no I/O, CPU time; reading the prompt "
        f"alone: {best['prompt']:.2f} µs/call); against two random choices for a call of no rollout, in the same "
        "blocks",
        f"{best['affine']:.2f} µs/call",
        f"two random choices: {best['p2c']:.2f} µs/call",
        best["affine"] < 5.0,
        "< 5 µs",
        best["p2c"] / best["affine"],
    )


def pick_rows(plan: ReplicasPlan) -> list[Row]:
    """The route's work per call (pick, count in flight, hear the answer) with no I/O: calls of no rollout among
    `pick_instances` instances, and rollouts among 4, 16 and 64 with and without the remembered slot winners."""
    answer: Any = SimpleNamespace(status=200, headers={}, connection=None)  # its body came with it
    per_rollout = plan.rollout_calls
    rollout_ids = (f"rollout-{n}" for n in itertools.count())

    def no_rollout(route: ServerRoute) -> Callable[[int], object]:
        def work(index: int) -> object:
            call = RoutedCall(route, None, PATH)
            call.answered(answer)
            return call.instance.url + PATH

        return work

    def rollouts(route: ServerRoute) -> Callable[[int], object]:
        current = [""]

        def work(index: int) -> object:
            if index % per_rollout == 0:
                current[0] = next(rollout_ids)  # a new rollout: its first call pins it
            call = RoutedCall(route, current[0], PATH)
            call.answered(answer)
            return call.instance.url + PATH

        return work

    urls = [f"http://10.0.0.{i}:8000" for i in range(plan.pick_instances)]
    cycle = itertools.cycle(urls)
    sides: dict[str, Callable[[int], object]] = {
        "rr": lambda index: next(cycle) + PATH,
        "p2c": no_rollout(_route(ServerRoute, plan.pick_instances)),
    }
    for count in PICK_COUNTS:
        cold = _route(ServerRoute, count)
        filled = _route(ServerRoute, count)
        for slot in range(SLOTS):  # every slot's winner remembered: the state once a run's rollouts filled them
            filled.slot_winner(slot, filled.pool)
        cold_work = rollouts(cold)

        def cold_block(index: int, route: ServerRoute = cold, work: Callable[[int], object] = cold_work) -> object:
            if index == 0:
                route.winners.clear()  # each block starts as a fresh process does: no winner remembered
            return work(index)

        sides[f"steady {count}"] = rollouts(filled)
        sides[f"cold {count}"] = cold_block
        sides[f"plain {count}"] = rollouts(_route(PlainRendezvousRoute, count))
    sides.update(affine_sides(plan))
    best = dict.fromkeys(sides, math.inf)
    for _ in range(plan.pick_blocks):
        for side, work in sides.items():
            best[side] = min(best[side], _us_per_call(plan.pick_calls, work))
    method = f"best of {plan.pick_blocks} interleaved blocks of {plan.pick_calls} calls, no I/O, CPU time"
    baseline = f"round robin (next(cycle(urls))): {best['rr']:.2f} µs/call"
    rows = [
        _absolute_row(
            "replicas",
            f"picking among {plan.pick_instances} instances, calls of no rollout: two random choices by calls in "
            f"flight, the call counted in flight and its answer heard ({method})",
            f"{best['p2c']:.2f} µs/call",
            baseline,
            best["p2c"] < 2.0,
            "< 2 µs",
            best["rr"] / best["p2c"],
        )
    ]
    for count in PICK_COUNTS:
        remembered, fresh, plain = best[f"steady {count}"], best[f"cold {count}"], best[f"plain {count}"]
        rows.append(
            _absolute_row(
                "replicas",
                f"picking among {count} instances, rollouts of {per_rollout} calls (a new rollout each time: its "
                f"first call pins it by rendezvous, the rest follow the pin), remembered slot winners against "
                f"plain rendezvous over the candidates ({method}; the first {plan.pick_calls // per_rollout} "
                f"rollouts of a fresh process, few winners remembered yet: {fresh:.2f} µs/call)",
                f"{remembered:.2f} µs/call",
                f"plain rendezvous: {plain:.2f} µs/call",
                remembered < 2.0 if count == plan.pick_instances else plain / remembered > 1.0,
                "< 2 µs" if count == plan.pick_instances else "pays (> 1x)",
                plain / remembered,
            )
        )
    rows.append(affine_row(plan, best))
    return rows


# --- four replicas, one 10x slower -------------------------------------------------------------------------------


@dataclass
class Block:
    latencies: list[float]  # of every call started in the block
    answered_in_time: int  # calls answered before the block's end
    seconds: float

    @property
    def throughput(self) -> float:
        return self.answered_in_time / self.seconds

    @property
    def p99(self) -> float:
        return percentile(self.latencies, 0.99)


async def run_for(post: Post, seconds: float, concurrency: int) -> Block:
    """`concurrency` workers posting for `seconds`: throughput counts the calls answered by then, latencies every
    call started by then (the ones still in flight at the end are waited for)."""
    started = time.monotonic()
    deadline = started + seconds
    latencies: list[float] = []
    in_time = [0]

    async def worker() -> None:
        while time.monotonic() < deadline:
            call_started = time.perf_counter()
            await post()
            latencies.append(time.perf_counter() - call_started)
            if time.monotonic() <= deadline:
                in_time[0] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Block(latencies, in_time[0], seconds)


async def slow_rows(plan: ReplicasPlan) -> list[Row]:
    slots = ["--slots", str(plan.slow_slots), "--delay-ms", str(plan.slow_delay_ms)]
    processes = start_replicas(4, *slots, slow=3, slow_delay_ms=plan.slow_delay_ms * 10)
    try:
        ports = [int(process.info["port"]) for process in processes]
        urls = [f"http://{LOOPBACK}:{port}{PATH}" for port in ports]
        client = replicated_client(ports)
        session = raw_session()
        cycle = itertools.cycle(urls)
        sides: dict[str, Post] = {
            "ours": ours_post(client),
            "round robin": raw_post(session, lambda: next(cycle)),
            "random": raw_post(session, lambda: random.choice(urls)),
        }
        blocks: dict[str, list[Block]] = {name: [] for name in sides}
        names = list(sides)
        for post in sides.values():  # warm: connections to every replica
            await run_for(post, 0.2, plan.slow_concurrency)
        for index in range(plan.slow_rounds * len(names)):  # rotating order: ABC, BCA, CAB, ...
            name = names[(index + index // len(names)) % len(names)]
            blocks[name].append(await run_for(sides[name], plan.slow_block_seconds, plan.slow_concurrency))
        await session.close()
        await close_http_sessions()
    finally:
        for process in processes:
            process.stop()
    ours = blocks["ours"]
    rows = []
    setup = (
        f"4 replicas serving {plan.slow_slots} calls at once each in {plan.slow_delay_ms:g} ms, one in "
        f"{plan.slow_delay_ms * 10:g} ms; concurrency {plan.slow_concurrency}, {plan.slow_rounds} rotating blocks "
        f"of {plan.slow_block_seconds:g} s per side"
    )
    for name in ("round robin", "random"):
        theirs = blocks[name]
        p99_ratio = median([t.p99 / o.p99 for o, t in zip(ours, theirs, strict=True)])
        # A block in which theirs answered nothing in time (a 0.3 s quick block on a loaded machine) has no ratio.
        rates = [o.throughput / t.throughput for o, t in zip(ours, theirs, strict=True) if t.throughput]
        rate_ratio = median(rates) if rates else math.inf
        goal = name == "round robin"
        rows.append(
            Row(
                "replicas",
                f"p99 latency against {name} ({setup}; ratio: theirs / ours, median of blocks)",
                f"two choices: {_ms(median([b.p99 for b in ours]))} ms",
                f"{name} (raw aiohttp): {_ms(median([b.p99 for b in theirs]))} ms",
                p99_ratio,
                "p99 ≤ 0.5x" if goal else "",
                p99_ratio >= 2.0 if goal else None,
                2.0 if goal else None,
            )
        )
        rows.append(
            Row(
                "replicas",
                f"throughput against {name} ({setup})",
                f"two choices: {median([b.throughput for b in ours]):.0f} req/s",
                f"{name} (raw aiohttp): {median([b.throughput for b in theirs]):.0f} req/s",
                rate_ratio,
                "≥ 1.5x" if goal else "",
                rate_ratio >= 1.5 if goal else None,
                1.5 if goal else None,
            )
        )
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


# --- kill -9 -----------------------------------------------------------------------------------------------------


class EjectionWatch(logging.Handler):
    """Hears the route's lines about one instance: when it was first ejected (time.monotonic()), and the attempts
    sent to it while it was out (between each ejection and its return on probation, or the end)."""

    def __init__(self, instance_id: str, route: Callable[[], ServerRoute | None]) -> None:
        super().__init__(logging.INFO)
        self.instance_id = f"instance {instance_id} "
        self.route = route
        self.at: float | None = None
        self.picks_while_out = 0
        self.returns = 0
        self._out_since_picks: int | None = None

    def _picks(self) -> int:
        route = self.route()
        return route.by_id[self.instance_id.split()[1]].picks if route is not None else 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith(self.instance_id):
            return
        if " ejected for " in message:
            self.at = time.monotonic() if self.at is None else self.at
            self._out_since_picks = self._picks()
        elif "returns to rotation" in message and self._out_since_picks is not None:
            self.picks_while_out += self._picks() - self._out_since_picks
            self._out_since_picks = None
            self.returns += 1

    def close_out(self) -> None:
        """At the end of the run: count an ejection still going on."""
        if self._out_since_picks is not None:
            self.picks_while_out += self._picks() - self._out_since_picks
            self._out_since_picks = None


@dataclass
class KillRun:
    failed: int
    calls: int
    killed_at: float
    paths: dict[str, list[int]]  # rollout -> the instance port of each of its calls


async def kill_run(
    post: Callable[[int], Awaitable[int]], processes: list[ServerProcess], plan: ReplicasPlan, per_rollout: int
) -> KillRun:
    """`kill_calls` calls by `kill_concurrency` workers (in rollouts of `per_rollout`, 1: none); the first replica
    gets SIGKILL once a quarter of them answered."""
    total = plan.kill_calls
    next_call = itertools.count()
    done = [0]
    failed = [0]
    killed_at = [math.inf]
    paths: dict[str, list[int]] = {}

    def kill_when_due() -> None:
        if done[0] >= total // 4 and killed_at[0] == math.inf:
            killed_at[0] = time.monotonic()
            os.kill(processes[0].pid, signal.SIGKILL)

    async def worker() -> None:
        while (index := next(next_call)) < total:
            rollout = index // per_rollout
            try:
                port = await post(rollout)
            except Exception:
                failed[0] += 1
            else:
                if per_rollout > 1:
                    paths.setdefault(f"r{rollout}", []).append(port)
            done[0] += 1
            kill_when_due()

    if per_rollout == 1:
        await asyncio.gather(*(worker() for _ in range(plan.kill_concurrency)))
    else:  # rollouts in flight at once, each making its calls one after the other
        rollout_ids = itertools.count()

        async def rollout_worker() -> None:
            while (rollout := next(rollout_ids)) * per_rollout < total:
                for _ in range(per_rollout):
                    try:
                        port = await post(rollout)
                    except Exception:
                        failed[0] += 1
                    else:
                        paths.setdefault(f"r{rollout}", []).append(port)
                    done[0] += 1
                    kill_when_due()

        await asyncio.gather(*(rollout_worker() for _ in range(plan.kill_concurrency)))
    return KillRun(failed[0], done[0], killed_at[0], paths)


async def _kill_ours(plan: ReplicasPlan, per_rollout: int) -> tuple[KillRun, EjectionWatch, int]:
    processes = start_replicas(4, "--delay-ms", str(plan.kill_delay_ms))
    ports = [int(process.info["port"]) for process in processes]
    client = replicated_client(ports)
    watch = EjectionWatch(
        f"{LOOPBACK}:{ports[0]}", lambda: client._routing.routes.get(NAME) if client._routing else None
    )
    logger = logging.getLogger(REPLICAS_LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)  # the returns too
    logger.addHandler(watch)
    post = ours_post(client)

    async def call(rollout: int) -> int:
        if per_rollout == 1:
            return await post()
        with rollout_context(f"r{rollout}"):
            return await post()

    try:
        run = await kill_run(call, processes, plan, per_rollout)
        watch.close_out()
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)
        await close_http_sessions()
        for process in processes:
            process.stop()
    return run, watch, ports[0]


async def _kill_round_robin(plan: ReplicasPlan) -> KillRun:
    processes = start_replicas(4, "--delay-ms", str(plan.kill_delay_ms))
    urls = [f"http://{LOOPBACK}:{process.info['port']}{PATH}" for process in processes]
    session = raw_session()
    cycle = itertools.cycle(urls)
    post = raw_post(session, lambda: next(cycle))
    try:
        return await kill_run(lambda rollout: post(), processes, plan, 1)
    finally:
        await session.close()
        for process in processes:
            process.stop()


def _after_known(watch: EjectionWatch) -> str:
    text = f"{watch.picks_while_out} calls while ejected"
    if watch.returns:  # a run longer than the ejection: on probation, it is tried (and fails over) again
        text += f", back on probation {watch.returns}x"
    return text


def _moves(ports: list[int]) -> int:
    """How many times a rollout's calls changed instance."""
    return sum(1 for before, after in itertools.pairwise(ports) if before != after)


def _moved_by_modulo(rollouts: int, dead: int = 0, count: int = 4) -> int:
    """Rollouts whose instance `hash(rollout) % N` changes when instance `dead` of `count` leaves."""
    moved = 0
    for n in range(rollouts):
        key = stable_key(f"r{n}")
        before = key % count
        survivors = [i for i in range(count) if i != dead]
        if before != survivors[key % (count - 1)]:
            moved += 1
    return moved


async def kill_rows(plan: ReplicasPlan) -> list[Row]:
    ours, watch, _ = await _kill_ours(plan, 1)
    theirs = await _kill_round_robin(plan)
    known_ms = (watch.at - ours.killed_at) * 1000 if watch.at is not None else math.inf
    setup = (
        f"kill -9 of one of 4 replicas a quarter into {plan.kill_calls:,} calls of no rollout, "
        f"concurrency {plan.kill_concurrency}"
    )
    rows = [
        _absolute_row(
            "replicas",
            f"failed calls ({setup})",
            f"{ours.failed} of {ours.calls}",
            f"round robin (raw aiohttp): {theirs.failed} of {theirs.calls}",
            ours.failed == 0,
            "0 failed",
            math.nan,
        ),
        _absolute_row(
            "replicas",
            f"the dead replica's death known (ejected) after the kill; calls sent to it while known dead "
            f"({setup})",
            f"{known_ms:.0f} ms; {_after_known(watch)}",
            "—",
            known_ms <= 1000 and watch.picks_while_out == 0,
            "≤ 1 s; 0 calls",
            math.nan,
        ),
    ]
    sticky, sticky_watch, dead_port = await _kill_ours(plan, plan.rollout_calls)
    on_dead = [rollout for rollout, ports in sticky.paths.items() if ports[0] == dead_port]
    wrongly_moved = sum(1 for ports in sticky.paths.values() if ports[0] != dead_port and _moves(ports))
    moved_twice = sum(1 for rollout in on_dead if _moves(sticky.paths[rollout]) > 1)
    rollouts = len(sticky.paths)
    known = (sticky_watch.at - sticky.killed_at) * 1000 if sticky_watch.at is not None else math.inf
    sticky_setup = (
        f"the same during rollouts of {plan.rollout_calls} calls ({rollouts} rollouts, "
        f"{plan.kill_concurrency} at once)"
    )
    rows += [
        _absolute_row(
            "replicas",
            f"rollouts moved by the kill, and failed calls ({sticky_setup})",
            f"{len(on_dead)} (the dead replica's), others moved: {wrongly_moved}, moved twice: {moved_twice}; "
            f"{sticky.failed} failed",
            f"hash(rollout) % N: {_moved_by_modulo(rollouts)} of {rollouts}",
            wrongly_moved == 0 and moved_twice == 0,
            "only the dead one's",
            math.nan,
        ),
        _absolute_row(
            "replicas",
            f"death known after the kill; calls sent to it while known dead ({sticky_setup})",
            f"{known:.0f} ms; {_after_known(sticky_watch)}",
            "—",
            known <= 1000 and sticky_watch.picks_while_out == 0,
            "≤ 1 s; 0 calls",
            math.nan,
        ),
    ]
    return rows


# --- a fifth replica ---------------------------------------------------------------------------------------------


class HeadProcess:
    """`gym-rpc head` on a config file of its own, on a free port (bounded start, stopped at exit)."""

    def __init__(self, doc: dict[str, Any], directory: Path) -> None:
        config = directory / "head.yaml"
        config.write_text(yaml.safe_dump(doc), encoding="utf-8")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gym_rpc", "head", "--config", str(config), "--probe-interval", "0.5"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=REPO_ROOT,
        )
        self.port = int(doc["head_server"]["port"])

    def stop(self) -> None:
        terminate(self.process)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


async def join_rows(plan: ReplicasPlan) -> list[Row]:
    head_port = _free_port()
    doc = {
        "head_server": {"host": LOOPBACK, "port": head_port},
        NAME: {SERVER_TYPE: {"bench": {"host": "0.0.0.0", "port": _free_port()}}},
    }
    processes: list[ServerProcess] = []
    with tempfile.TemporaryDirectory() as directory:
        head = HeadProcess(doc, Path(directory))
        try:
            client = await asyncio.to_thread(_client_when_up, head_port)
            register = [
                "--register",
                f"{LOOPBACK}:{head_port}",
                "--name",
                NAME,
                "--delay-ms",
                str(plan.kill_delay_ms),
            ]
            processes = await asyncio.to_thread(start_replicas, plan.join_replicas, *register)
            post = ours_post(client)
            await post()

            def all_listed() -> bool:
                route = client._routing.routes.get(NAME) if client._routing else None
                # The first replica holds the config's (wildcard) instance, the others add one each.
                return route is not None and len(route.instances) >= plan.join_replicas

            listed = await asyncio.to_thread(wait_until, all_listed, plan.join_wait_seconds)
            seen: dict[int, float] = {}
            stop, fifth_answered = asyncio.Event(), asyncio.Event()
            fifth_port = [0]

            async def worker() -> None:
                while not stop.is_set():
                    port = await post()
                    seen.setdefault(port, time.monotonic())
                    if port == fifth_port[0]:
                        fifth_answered.set()

            workers = [asyncio.create_task(worker()) for _ in range(16)]
            fifth = await asyncio.to_thread(ServerProcess, "replica", *register)
            registered_at = time.monotonic()  # its READY line comes after the head accepted its registration
            processes.append(fifth)
            port = fifth_port[0] = int(fifth.info["port"])
            if port in seen:
                fifth_answered.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fifth_answered.wait(), plan.join_wait_seconds)
            stop.set()
            await asyncio.gather(*workers)
            await close_http_sessions()
        finally:
            for process in processes:
                process.stop()
            head.stop()
    delay = seen.get(port, math.inf) - registered_at
    return [
        _absolute_row(
            "replicas",
            f"a fifth replica registers with the head ({plan.join_replicas} registered, calls of no rollout at "
            f"concurrency 16): from its registration to its first answered call (listed at start: {listed})",
            f"{delay * 1000:.0f} ms",
            "—",
            delay <= 1.0,
            "≤ 1 s",
            math.nan,
        )
    ]


def _client_when_up(head_port: int) -> ServerClient:
    deadline = time.monotonic() + 30
    while True:
        try:
            return ServerClient.load_from_global_config(BaseServerConfig(host=LOOPBACK, port=head_port))
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


SECTIONS: dict[str, Callable[[ReplicasPlan], list[Row]]] = {
    "replicas-pick": pick_rows,
    "replicas-slow": lambda plan: asyncio.run(slow_rows(plan)),
    "replicas-kill": lambda plan: asyncio.run(kill_rows(plan)),
    "replicas-join": lambda plan: asyncio.run(join_rows(plan)),
}


def rows(plan: ReplicasPlan, sections: set[str]) -> list[Row]:
    found: list[Row] = []
    for name, run in SECTIONS.items():
        if name in sections:
            print(f"bench: {name}", file=sys.stderr, flush=True)
            found += run(plan)
    return found
