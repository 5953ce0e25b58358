"""What one of gym_rpc's per-process switches (tracing, worker metrics) costs a rollout worker: `ServerClient.post`
requests per second with it on over the same with it off, both in one process against the same data server, in
rounds of short interleaved blocks (on/off/off/on, off/on/on/off, ...: bench.data_plane's method, the collector on
and left alone beside the same live heap of rollout records), the figure being the median of the per-round ratios.

A switch is a per-process decision that never turns off again, so each benchmark flips gym_rpc's flag between
blocks itself and runs in a process of its own (`rows_in_subprocess`), so that nothing of it leaks into the
others. `tracing_cost` and `metrics_cost` say what "on" is; this module runs and reports them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.data_plane import (
    LIVE_HEAP_RECORDS,
    Block,
    LiveHeap,
    Post,
    abba_rounds,
    make_client,
    ours_post,
    rollout_buffers,
)
from bench.servers import REPO_ROOT, ServerProcess
from bench.stats import Row, median, ratio_row, spread_text, table_lines
from gym_rpc.client._http import close_http_sessions


@dataclass(frozen=True)
class FlagPlan:
    """Requests per block at each concurrency, and rounds of four blocks each (bench.data_plane's sizes: short
    blocks, many rounds; 80, as its rows: at 40 the c=64 tracing median moved by about ±0.01 from run to run, as
    much as the margin its goal is decided by)."""

    concurrencies: tuple[int, ...] = (1, 64)
    requests: tuple[int, ...] = (100, 512)
    rounds: int = 80
    live_heap_records: int = LIVE_HEAP_RECORDS


FULL_PLAN = FlagPlan()
QUICK_PLAN = FlagPlan(requests=(30, 128), rounds=2, live_heap_records=10_000)

TimedBlock = Callable[[Post, int, int, bool], Awaitable[Block]]


@dataclass(frozen=True)
class FlagCost:
    """One switch's benchmark: how to turn it on for the process, how to run one block with it on or off."""

    name: str  # "tracing": progress lines and the table's area
    measure: str  # "ServerClient.post traced / untraced"
    on_label: str  # "traced": in "+N µs CPU/req traced"
    install: Callable[[], None]
    timed_block: TimedBlock
    goals: Mapping[int, float] = field(default_factory=dict)  # concurrency -> minimum ratio


@contextmanager
def switched(state: Any, on: bool) -> Iterator[None]:
    """gym_rpc's `state.enabled` flag (TRACING, METRICS) for one block: benchmarks only, as a process never turns
    its switch off."""
    previous = state.enabled
    state.enabled = on
    try:
        yield
    finally:
        state.enabled = previous


@dataclass
class Rounds:
    concurrency: int
    ratios: list[float] = field(default_factory=list)
    on: list[Block] = field(default_factory=list)
    off: list[Block] = field(default_factory=list)


async def interleaved(cost: FlagCost, post: Post, concurrency: int, requests: int, rounds: int) -> Rounds:
    """bench.data_plane's `abba_rounds` of the switch on (A) against off (B), the collector left alone: a side
    that keeps more objects alive (spans held until export) pays for the collections they cause."""
    warm = max(requests, concurrency)
    await cost.timed_block(post, warm, concurrency, True)
    await cost.timed_block(post, warm, concurrency, False)
    result = Rounds(concurrency)
    result.ratios, result.on, result.off = await abba_rounds(
        lambda: cost.timed_block(post, requests, concurrency, True),
        lambda: cost.timed_block(post, requests, concurrency, False),
        rounds,
    )
    print(
        f"  {cost.name} c={concurrency}: per-round ratios {' '.join(f'{r:.2f}' for r in result.ratios)}",
        file=sys.stderr,
    )
    return result


def row_of(cost: FlagCost, rounds: Rounds, heap: LiveHeap) -> Row:
    on_rps = median([b.requests_per_second for b in rounds.on])
    off_rps = median([b.requests_per_second for b in rounds.off])
    on_cpu = median([b.cpu_us_per_request for b in rounds.on])
    off_cpu = median([b.cpu_us_per_request for b in rounds.off])
    ratios = rounds.ratios
    spread = spread_text(ratios)
    return ratio_row(
        cost.name,
        f"{cost.measure}, concurrency {rounds.concurrency} "
        f"(req/s; GC on beside {heap.describe()}; median of per-round ratios, {spread}; "
        f"+{on_cpu - off_cpu:.0f} µs CPU/req {cost.on_label})",
        f"on: {on_rps:.0f} req/s, {on_cpu:.0f} µs CPU/req",
        f"off: {off_rps:.0f} req/s, {off_cpu:.0f} µs CPU/req",
        median(rounds.ratios),
        cost.goals.get(rounds.concurrency),
    )


async def run(cost: FlagCost, port: int, plan: FlagPlan) -> list[Row]:
    cost.install()
    client = make_client(port, observability_enabled=True)  # rollout prefixes on, as observed deployments run
    post = ours_post(client)
    rows: list[Row] = []
    heap = rollout_buffers(plan.live_heap_records)  # beside the client while the blocks run, as in a worker
    try:
        for concurrency, requests in zip(plan.concurrencies, plan.requests, strict=True):
            rows.append(row_of(cost, await interleaved(cost, post, concurrency, requests, plan.rounds), heap))
    finally:
        await close_http_sessions()
    return rows


def rows_in_subprocess(module: str, port: int, quick: bool = False) -> list[Row]:
    """Run `python -m <module>` (a benchmark of this kind) in a fresh interpreter, as a switch is decided per
    process, against the data server on `port`; its rows."""
    command = [sys.executable, "-m", module, f"--port={port}", "--json", *(["--quick"] if quick else [])]
    completed = subprocess.run(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, timeout=600, check=True)
    return [Row(**fields) for fields in json.loads(completed.stdout)]


def main(cost: FlagCost, prog: str, doc: str | None, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--port", type=int, help="a running data server (python -m bench.servers data)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.port is not None:
        rows = asyncio.run(run(cost, args.port, plan))
    else:
        with ServerProcess("data") as data:
            rows = asyncio.run(run(cost, int(data.info["port"]), plan))
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows]))
    else:
        print("\n".join(table_lines(rows)))
    return 0
