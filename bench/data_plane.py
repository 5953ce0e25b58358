"""Data plane: `ServerClient.post(name, "/v1/responses", json=...)` (as NeMo Gym code calls it) against the best
raw aiohttp a user could write by hand, `session.post(url, data=orjson.dumps(body))`, to the same server in another
process, at several concurrencies. Both sides parse the answer with `orjson.loads`, as NeMo Gym's
`get_response_json` does.

Measured as rollout workers run: each side in a process of its own (bench/side_worker.py), with its own live heap
(`rollout_buffers`: what a worker holds of its rollouts), so every full collection scans what it would scan in a
worker, and its own garbage collector, on and left alone (nothing frozen, nothing collected between blocks): each
side pays for exactly the collections its own objects cause. Clients and server are pinned to separate cores where
the machine has two (bench/__main__.py).

Rounds alternate which side goes first (ABBA, BAAB, ...), one block at a time; each round yields one ratio (ours /
raw requests per second), and the figure is the median of those ratios, so a noisy second on two shared cores
moves single rounds, not the result. Blocks are short (a few tenths of a second) and rounds many: a burst of load
from elsewhere then spans both sides of a round. Client CPU per request (the side's process time over requests) is
reported beside the ratio: it is what the client adds, and what the ratio hides once the server is the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp.payload import JsonPayload
from omegaconf import OmegaConf

from bench.servers import ServerProcess, pinned_apart
from bench.side_worker import rounds_per_pair, side_pair
from bench.stats import (
    UNLIMITED,
    Budget,
    Row,
    interleaved_latencies,
    median,
    pair_budget,
    percentile,
    ratio_row,
    settled,
    spread_text,
    table_lines,
)
from gym_rpc.client.data._http import json_payload
from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig

SERVER_NAME = "policy_model"
PATH = "/v1/responses"
# A Responses API request of a typical short turn (~1 KB of JSON).
PAYLOAD: dict[str, Any] = {
    "model": "policy",
    "input": [
        {"role": "system", "content": "You are a careful math tutor. Think step by step. " * 4},
        {"role": "user", "content": "What is 6 * 7? Explain the multiplication in detail. " * 8},
    ],
    "max_output_tokens": 256,
    "temperature": 1.0,
    "top_p": 1.0,
}
JSON_HEADERS = {"Content-Type": "application/json"}  # what a hand-written raw post sends with its orjson bytes
# gym_rpc's default data pool: the raw session gets the same limits and deadline, so both open and time alike.
POOL = HttpClientSettings()

Post = Callable[[], Awaitable[None]]
# Minimum ratio to raw aiohttp + orjson, per concurrency (DESIGN's performance targets).
RATIO_GOALS = {1: 0.95, 64: 0.97, 512: 0.97, 2048: 0.97, 4096: 0.97}
LIVE_HEAP_RECORDS = 300_000


@dataclass(frozen=True)
class LiveHeap:
    """What a rollout worker's heap holds beside its client, alive while the blocks run: its rollout records."""

    records: list[dict[str, Any]]

    def tracked_objects(self) -> int:
        """The objects of the heap the collector tracks (and every full collection scans)."""
        return sum(1 for record in self.records if gc.is_tracked(record)) + sum(
            1 for record in self.records if gc.is_tracked(record["token_ids"])
        )

    def describe(self) -> str:
        return f"a live heap of {len(self.records):,} small dicts ({self.tracked_objects():,} objects tracked)"


def rollout_buffers(records: int) -> LiveHeap:
    """`records` small dicts as a worker keeps its rollouts (an id, a reward, a few token ids). Each holds a list,
    so the collector tracks both (a dict of numbers and strings alone it does not track, and would never scan)."""
    return LiveHeap([{"rollout_id": i, "reward": 0.0, "token_ids": [i, 1, 2, 3]} for i in range(records)])


def make_client(port: int, **global_keys: Any) -> ServerClient:
    doc = {
        "head_server": {"host": "127.0.0.1", "port": 1},  # never called: the data plane needs no head
        SERVER_NAME: {"responses_api_models": {"bench_model": {"host": "127.0.0.1", "port": port}}},
        **global_keys,
    }
    head = BaseServerConfig(host="127.0.0.1", port=1)
    return ServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))


def raw_session(limit: int = POOL.max_connections) -> aiohttp.ClientSession:
    """Raw aiohttp set up as gym_rpc's data pool is: its connection limits, its total deadline per call, and no
    cookie jar (aiohttp's default jar costs a few µs per call). So the ratio isolates what ServerClient adds on top
    of aiohttp, nothing else."""
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=POOL.max_connections_per_host)
    timeout = aiohttp.ClientTimeout(total=POOL.total_timeout_seconds, sock_connect=POOL.connect_timeout_seconds)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar())


def ours_post(client: ServerClient) -> Post:
    async def post() -> None:
        async with await client.post(SERVER_NAME, PATH, json=PAYLOAD) as response:
            orjson.loads(await response.read())

    return post


def raw_post(session: aiohttp.ClientSession, url: str) -> Post:
    async def post() -> None:
        async with session.post(url, data=orjson.dumps(PAYLOAD), headers=JSON_HEADERS) as response:
            orjson.loads(await response.read())

    return post


@dataclass
class Block:
    requests_per_second: float
    cpu_us_per_request: float
    # The collector's runs during the block per 10,000 requests, by generation (young, middle, full).
    collections_per_10k: tuple[float, ...] = (0.0, 0.0, 0.0)


def _collections() -> list[int]:
    return [generation["collections"] for generation in gc.get_stats()]


async def run_block(post: Post, requests: int, concurrency: int) -> Block:
    """`requests` calls by `concurrency` workers; wall time, this process's CPU time, and the collections run."""
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await post()

    collections = _collections()
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - started_wall, time.process_time() - started_cpu
    ran = [after - before for before, after in zip(collections, _collections(), strict=True)]
    return Block(requests / wall, cpu / requests * 1e6, tuple(count * 1e4 / requests for count in ran))


def collections_text(blocks: list[Block]) -> str:
    """The collector's runs per 10,000 requests over the blocks (young / middle / full generation)."""
    runs = [sum(b.collections_per_10k[generation] for b in blocks) / len(blocks) for generation in range(3)]
    return "GC runs per 10k req " + "/".join(f"{count:.0f}" for count in runs)


@dataclass
class Comparison:
    concurrency: int
    ratios: list[float] = field(default_factory=list)
    ours: list[Block] = field(default_factory=list)
    raw: list[Block] = field(default_factory=list)
    by_pair: list[list[float]] = field(default_factory=list)  # the ratios of each pair of side processes

    def add_pair(self, pair: Comparison) -> None:
        """The rounds one more pair of side processes made (bench.side_worker.side_pair)."""
        self.ratios += pair.ratios
        self.ours += pair.ours
        self.raw += pair.raw
        self.by_pair.append(pair.ratios)


async def one_round(
    side_a: Callable[[], Awaitable[Block]], side_b: Callable[[], Awaitable[Block]], a_first: bool
) -> tuple[float, list[Block], list[Block]]:
    """One round of four blocks, ABBA (`a_first`) or BAAB: A's requests per second over B's, and the blocks."""
    order = (side_a, side_b, side_b, side_a) if a_first else (side_b, side_a, side_a, side_b)
    round_a: list[Block] = []
    round_b: list[Block] = []
    for side in order:
        (round_a if side is side_a else round_b).append(await side())
    # Equal requests per block: the ratio of requests per second is the inverse ratio of summed times.
    ratio = sum(1 / b.requests_per_second for b in round_b) / sum(1 / b.requests_per_second for b in round_a)
    return ratio, round_a, round_b


async def abba_rounds(
    side_a: Callable[[], Awaitable[Block]],
    side_b: Callable[[], Awaitable[Block]],
    rounds: int,
    budget: Budget = UNLIMITED,
) -> tuple[list[float], list[Block], list[Block]]:
    """Rounds of four blocks, ABBA then BAAB: whichever side runs first after a switch pays for the switch (idle
    connections, caches), and in a round each side runs once first and once second, so that cost cancels. The
    collector is left alone, as in a worker: a collection runs in whichever block its threshold is crossed, each
    side's as often over many rounds, and a side that keeps more objects alive crosses it more often. Returns the
    per-round ratios (A's requests per second over B's) and the blocks of A and of B; fewer than `rounds` once the
    `budget` is spent."""
    ratios: list[float] = []
    blocks_a: list[Block] = []
    blocks_b: list[Block] = []
    started = time.monotonic()
    for index in range(rounds):
        if budget.spent(index, started):
            break
        ratio, round_a, round_b = await one_round(side_a, side_b, index % 2 == 0)
        ratios.append(ratio)
        blocks_a += round_a
        blocks_b += round_b
    return ratios, blocks_a, blocks_b


async def compare(
    ours: Post, raw: Post, concurrency: int, requests: int, rounds: int, budget: Budget = UNLIMITED
) -> Comparison:
    """`compare_blocks` of two posts in this process (bench.hot_path: two clients of the same library)."""
    return await compare_blocks(
        lambda: run_block(ours, requests, concurrency),
        lambda: run_block(raw, requests, concurrency),
        concurrency,
        rounds,
        budget,
    )


async def compare_blocks(
    ours: Callable[[], Awaitable[Block]],
    raw: Callable[[], Awaitable[Block]],
    concurrency: int,
    rounds: int,
    budget: Budget = UNLIMITED,
) -> Comparison:
    """`abba_rounds` of gym_rpc's blocks against the raw ones, after a warm block of each (connections, caches)."""
    await ours()
    await raw()
    result = Comparison(concurrency)
    result.ratios, result.ours, result.raw = await abba_rounds(ours, raw, rounds, budget)
    print(
        f"  data plane c={concurrency}: per-round ratios {' '.join(f'{r:.2f}' for r in result.ratios)}",
        file=sys.stderr,
    )
    return result


def cpu_ratios(ours: Sequence[Block], raw: Sequence[Block]) -> list[float]:
    """Per round, our client CPU per request over raw aiohttp's (each side's two blocks of the round, in the order
    `abba_rounds` made them): what "our CPU per request stays within 2 % of raw aiohttp's" is judged by, with the
    scatter of its rounds beside its median."""
    return [
        sum(b.cpu_us_per_request for b in ours[i : i + 2]) / sum(b.cpu_us_per_request for b in raw[i : i + 2])
        for i in range(0, min(len(ours), len(raw)) - 1, 2)
    ]


def cpu_text(ours: Sequence[Block], raw: Sequence[Block]) -> str:
    """ "CPU/req ours ÷ raw per round: median 1.01, middle half 0.98-1.04"."""
    ratios = cpu_ratios(ours, raw)
    return (
        f"CPU/req ours ÷ raw per round: median {median(ratios):.3f}, "
        f"middle half {percentile(ratios, 0.25):.2f}-{percentile(ratios, 0.75):.2f}"
    )


def rows_of(comparison: Comparison, heap: str) -> list[Row]:
    ours_rps = median([b.requests_per_second for b in comparison.ours])
    raw_rps = median([b.requests_per_second for b in comparison.raw])
    ours_cpu = median([b.cpu_us_per_request for b in comparison.ours])
    raw_cpu = median([b.cpu_us_per_request for b in comparison.raw])
    spread = spread_text(comparison.ratios, comparison.by_pair)
    return [
        ratio_row(
            "data plane",
            f"POST /v1/responses with json= (baseline: data=orjson.dumps(body)), concurrency "
            f"{comparison.concurrency}, GC on beside {heap} in each side's process "
            f"(median of per-round ratios, {spread}; {cpu_text(comparison.ours, comparison.raw)})",
            f"{ours_rps:.0f} req/s, {ours_cpu:.0f} µs CPU/req, {collections_text(comparison.ours)}",
            f"raw aiohttp + orjson: {raw_rps:.0f} req/s, {raw_cpu:.0f} µs CPU/req, "
            f"{collections_text(comparison.raw)}",
            median(comparison.ratios),
            RATIO_GOALS.get(comparison.concurrency),
        )
    ]


def serialisation_row(pairs: int, batch: int = 200) -> Row:
    """What a `json=` body costs to serialise: gym_rpc's (orjson, as NeMo Gym's client) against aiohttp's own
    `json=` (a JsonPayload made with the standard library's `json.dumps`), both into the payload aiohttp sends."""

    def ours() -> None:
        for _ in range(batch):
            json_payload(PAYLOAD)

    def aiohttp_default() -> None:
        for _ in range(batch):
            JsonPayload(PAYLOAD)

    mine, theirs = interleaved_latencies(ours, aiohttp_default, pairs)
    return ratio_row(
        "data plane",
        f"serialise a json= body (~1 KB) into the payload sent (median of {pairs} interleaved batches)",
        f"orjson: {mine.p50_ms * 1e3 / batch:.1f} µs",
        f"aiohttp's json= (json.dumps): {theirs.p50_ms * 1e3 / batch:.1f} µs",
        theirs.p50_ms / mine.p50_ms,
        1.0,
    )


@dataclass(frozen=True)
class DataPlanePlan:
    concurrencies: tuple[int, ...] = (1, 64, 512, 2048, 4096)
    # Short blocks, many rounds: the four blocks of a round run within a second or so, so a burst of load from
    # elsewhere hits both sides, and the median of the rounds' ratios shrugs off the rounds it hit unevenly. From
    # 512 up a block is one request per worker: on a loaded two-core machine, blocks of two per worker scattered
    # about three times as much per second of bench.
    requests: tuple[int, ...] = (100, 256, 512, 2048, 4096)
    # Rounds per concurrency: what keeps each row's middle half within about ±0.03 of its median in a few tens of
    # seconds (bench/RESULTS.md's notes say how that was found).
    rounds: tuple[int, ...] = (80, 80, 80, 60, 40)
    # Seconds of rounds per concurrency, over all pairs (bench.stats.Budget): about what the rounds above take on
    # a quiet machine (c=4,096: 40 rounds of four 1.1 s blocks), so a loaded one makes fewer rounds (at least 10)
    # instead of a run several times as long: at load 8-10 one pair's 15 rounds at 2,048 took 262 s.
    seconds: tuple[float, ...] = (20.0, 20.0, 40.0, 120.0, 150.0)
    # Pairs of side processes (bench.side_worker.side_pair), one after the other, each making an equal share of
    # every row's rounds: with one pair, a row moved by up to ±0.04 with the processes it happened to get.
    pairs: int = 4
    serialisation_pairs: int = 50
    live_heap_records: int = LIVE_HEAP_RECORDS


# A smoke run (tests/bench/test_bench_smoke.py): every row once, on one pair of side processes (the pairs' spread
# is tested on its own there); two pairs of two rounds took twice as long for figures that mean nothing either way.
QUICK_DATA_PLANE = DataPlanePlan(
    concurrencies=(1, 64, 512, 2048),
    requests=(20, 64, 512, 2048),
    rounds=(1, 1, 1, 1),
    seconds=(20.0, 20.0, 40.0, 120.0),
    pairs=1,
    serialisation_pairs=3,
    live_heap_records=10_000,
)


async def run(port: int, plan: DataPlanePlan) -> list[Row]:
    """The rows, each side in a process of its own (bench.side_worker: its own heap and collector, as a worker)."""
    rows = [serialisation_row(plan.serialisation_pairs)]
    comparisons = [Comparison(concurrency) for concurrency in plan.concurrencies]
    heap = ""
    for pair in range(plan.pairs):
        # A row whose median is known well enough takes no more pairs (bench.stats.settled): the long blocks at
        # 2,048 and 4,096 calls in flight are most of the run.
        remaining = [
            (comparison, requests, rounds, seconds)
            for comparison, requests, rounds, seconds in zip(
                comparisons, plan.requests, plan.rounds, plan.seconds, strict=True
            )
            if not settled(comparison.ratios, comparison.by_pair)
        ]
        if not remaining:
            break
        with side_pair("ours", "raw", port, plan.live_heap_records) as (ours, raw):
            heap = ours.heap
            for comparison, requests, rounds, seconds in remaining:
                concurrency = comparison.concurrency
                started = time.monotonic()

                async def ours_block(concurrency: int = concurrency, requests: int = requests) -> Block:
                    return Block(*ours.block(concurrency, requests))

                async def raw_block(concurrency: int = concurrency, requests: int = requests) -> Block:
                    return Block(*raw.block(concurrency, requests))

                share = await compare_blocks(
                    ours_block,
                    raw_block,
                    concurrency,
                    rounds_per_pair(rounds, plan.pairs),
                    pair_budget(seconds, plan.pairs),
                )
                comparison.add_pair(share)
                print(
                    f"  data plane c={concurrency}: pair {pair + 1} of {plan.pairs} took "
                    f"{time.monotonic() - started:.0f} s",
                    file=sys.stderr,
                )
    return rows + [row for comparison in comparisons for row in rows_of(comparison, heap)]


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.data_plane --concurrency 4096 --rounds 20`: chosen data-plane rows alone, against a data
    server of their own pinned apart from the client, as `make bench` runs them: a row rerun without the rest."""
    parser = argparse.ArgumentParser(prog="python -m bench.data_plane", description=main.__doc__)
    parser.add_argument("--concurrency", type=int, action="append", help="repeatable; default: every one")
    parser.add_argument("--rounds", type=int, help="rounds per row (default: the plan's)")
    args = parser.parse_args(argv)
    full = DataPlanePlan()
    chosen = [i for i, c in enumerate(full.concurrencies) if not args.concurrency or c in args.concurrency]
    plan = DataPlanePlan(
        concurrencies=tuple(full.concurrencies[i] for i in chosen),
        requests=tuple(full.requests[i] for i in chosen),
        rounds=tuple(args.rounds or full.rounds[i] for i in chosen),
        # rounds asked for are made whatever they take
        seconds=tuple(math.inf if args.rounds else full.seconds[i] for i in chosen),
    )
    with ServerProcess("data") as data, pinned_apart(data.pid):
        rows = asyncio.run(run(int(data.info["port"]), plan))
    print("\n".join(table_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
