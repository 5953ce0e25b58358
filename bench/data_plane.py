"""Data plane: `ServerClient.post(name, "/v1/responses", json=...)` (as NeMo Gym code calls it) against the best
raw aiohttp a user could write by hand, `session.post(url, data=orjson.dumps(body))`, to the same server in another
process, at several concurrencies. Both sides parse the answer with `orjson.loads`, as NeMo Gym's
`get_response_json` does.

Rounds alternate which side goes first (ABBA, BAAB, ...); each round yields one ratio (ours / raw requests per
second), and the figure is the median of those ratios, so a noisy second on two shared cores moves single rounds,
not the result. Blocks are short (a few tenths of a second) and rounds many: a burst of load from elsewhere then
spans both sides of a round. The garbage collector is kept fair: each block starts on a collected heap, so one
side's garbage is never collected on the other side's clock, and what the process built before measuring
(imports, clients) is frozen, so a full collection, whichever block it lands in, costs what the requests left
rather than the size of the imports. Client CPU per request (process time over requests) is reported beside the
ratio: it is what the client adds, and what the ratio hides once the server is the bottleneck.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp.payload import JsonPayload
from omegaconf import OmegaConf

from bench.stats import Row, interleaved_latencies, median, percentile, ratio_row
from gym_rpc.client._http import HttpClientSettings, close_http_sessions
from gym_rpc.client.server_client import ServerClient
from gym_rpc.client.server_client import _json_payload as json_body_payload
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


async def run_block(post: Post, requests: int, concurrency: int) -> Block:
    """`requests` calls by `concurrency` workers; wall time and this process's CPU time."""
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await post()

    started_wall, started_cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, cpu = time.perf_counter() - started_wall, time.process_time() - started_cpu
    return Block(requests / wall, cpu / requests * 1e6)


@dataclass
class Comparison:
    concurrency: int
    ratios: list[float] = field(default_factory=list)
    ours: list[Block] = field(default_factory=list)
    raw: list[Block] = field(default_factory=list)


async def abba_rounds(
    side_a: Callable[[], Awaitable[Block]], side_b: Callable[[], Awaitable[Block]], rounds: int
) -> tuple[list[float], list[Block], list[Block]]:
    """Rounds of four blocks, ABBA then BAAB: whichever side runs first after a switch pays for the switch (idle
    connections, caches), and in a round each side runs once first and once second, so that cost cancels. Each
    block starts on a collected heap (the collection untimed): what it is charged for collecting is its own
    garbage, never the previous block's. Returns the per-round ratios (A's requests per
    second over B's) and the blocks of A and of B."""
    ratios: list[float] = []
    blocks_a: list[Block] = []
    blocks_b: list[Block] = []
    for index in range(rounds):
        order = (side_a, side_b, side_b, side_a) if index % 2 == 0 else (side_b, side_a, side_a, side_b)
        round_a: list[Block] = []
        round_b: list[Block] = []
        for side in order:
            gc.collect()
            (round_a if side is side_a else round_b).append(await side())
        blocks_a += round_a
        blocks_b += round_b
        # Equal requests per block: the ratio of requests per second is the inverse ratio of summed times.
        ratios.append(
            sum(1 / b.requests_per_second for b in round_b) / sum(1 / b.requests_per_second for b in round_a)
        )
    return ratios, blocks_a, blocks_b


async def compare(ours: Post, raw: Post, concurrency: int, requests: int, rounds: int) -> Comparison:
    """`abba_rounds` of gym_rpc's post against the raw one, after a warm block of each."""
    await run_block(ours, max(requests, concurrency), concurrency)  # warm: connections, caches
    await run_block(raw, max(requests, concurrency), concurrency)
    result = Comparison(concurrency)
    result.ratios, result.ours, result.raw = await abba_rounds(
        lambda: run_block(ours, requests, concurrency), lambda: run_block(raw, requests, concurrency), rounds
    )
    print(
        f"  data plane c={concurrency}: per-round ratios {' '.join(f'{r:.2f}' for r in result.ratios)}",
        file=sys.stderr,
    )
    return result


def rows_of(comparison: Comparison) -> list[Row]:
    ours_rps = median([b.requests_per_second for b in comparison.ours])
    raw_rps = median([b.requests_per_second for b in comparison.raw])
    ours_cpu = median([b.cpu_us_per_request for b in comparison.ours])
    raw_cpu = median([b.cpu_us_per_request for b in comparison.raw])
    ratios = comparison.ratios
    spread = f"{len(ratios)} rounds, middle half {percentile(ratios, 0.25):.2f}-{percentile(ratios, 0.75):.2f}"
    return [
        ratio_row(
            "data plane",
            f"POST /v1/responses with json= (baseline: data=orjson.dumps(body)), concurrency "
            f"{comparison.concurrency} (median of per-round ratios, {spread})",
            f"{ours_rps:.0f} req/s, {ours_cpu:.0f} µs CPU/req",
            f"raw aiohttp + orjson: {raw_rps:.0f} req/s, {raw_cpu:.0f} µs CPU/req",
            median(comparison.ratios),
            0.95,
        )
    ]


def serialisation_row(pairs: int, batch: int = 200) -> Row:
    """What a `json=` body costs to serialise: gym_rpc's (orjson, as NeMo Gym's client) against aiohttp's own
    `json=` (a JsonPayload made with the standard library's `json.dumps`), both into the payload aiohttp sends."""

    def ours() -> None:
        for _ in range(batch):
            json_body_payload(PAYLOAD)

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
    concurrencies: tuple[int, ...] = (1, 64, 512)
    # Short blocks, many rounds: the four blocks of a round run within a second or so, so a burst of load from
    # elsewhere hits both sides, and the median of the rounds' ratios shrugs off the rounds it hit unevenly. At 512
    # a block is one request per worker: on a loaded two-core machine, blocks of two per worker scattered
    # about three times as much per second of bench.
    requests: tuple[int, ...] = (100, 256, 512)
    rounds: int = 80
    serialisation_pairs: int = 50


QUICK_DATA_PLANE = DataPlanePlan(requests=(20, 64, 512), rounds=1, serialisation_pairs=3)


async def run(port: int, plan: DataPlanePlan) -> list[Row]:
    client = make_client(port)
    url = f"http://127.0.0.1:{port}{PATH}"
    session = raw_session()
    rows = [serialisation_row(plan.serialisation_pairs)]
    gc.collect()
    gc.freeze()  # what this process built before measuring (imports, clients, servers' handles) is settled heap
    try:
        for concurrency, requests in zip(plan.concurrencies, plan.requests, strict=True):
            comparison = await compare(
                ours_post(client), raw_post(session, url), concurrency, requests, plan.rounds
            )
            rows.extend(rows_of(comparison))
    finally:
        gc.unfreeze()
        await session.close()
        await close_http_sessions()
    return rows
