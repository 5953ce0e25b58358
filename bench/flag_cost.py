"""What one of gym_rpc's per-process switches (tracing, worker metrics) costs a rollout worker: `ServerClient.post`
requests per second with it on over the same with it off, against the same data server, in rounds of short
interleaved blocks (on/off/off/on, off/on/on/off, ...), the figure being the median of the per-round ratios:
bench.data_plane's method. As there, each side runs in a process of its own (bench.side_worker `MODULE:on` and
`MODULE:off`), as a worker: its own live heap of rollout records, its own collector, on and left alone, and, on,
its own SDK provider and span queue. (In one process the two sides shared the collector and the spans queued for
export, and a full collection was paid by whichever block crossed its threshold.)

A switch is a per-process decision that never turns off again, so each side's process sets gym_rpc's flag for
each block itself. `tracing_cost`, `tracing_sampled_cost` and `metrics_cost` say what "on" is; this module runs
and reports them.

A cost may have a peer: the same switch in the library a user would otherwise reach for (tracing's is
`opentelemetry-instrumentation-aiohttp-client` on raw aiohttp, bench.tracing_peer). `run_against_peer` then keeps
four processes (ours on and off, the peer's on and off) and interleaves the two comparisons round by round, so the
same load hits both; its third row per concurrency is the median of the per-round quotients (our on/off ratio over
the peer's), and a goal there says "costs no more than the peer".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.data_plane import LIVE_HEAP_RECORDS, Block, Post, abba_rounds, one_round
from bench.servers import ServerProcess
from bench.side_worker import SideWorker, rounds_per_pair, side_pair
from bench.stats import UNLIMITED, Budget, Row, median, pair_budget, ratio_row, settled, spread_text, table_lines


@dataclass(frozen=True)
class FlagPlan:
    """Requests per block at each concurrency, and rounds of four blocks each (bench.data_plane's sizes: short
    blocks, many rounds; 80, as its rows: at 40 the c=64 tracing median moved by about ±0.01 from run to run, as
    much as the margin its goal is decided by)."""

    concurrencies: tuple[int, ...] = (1, 64)
    requests: tuple[int, ...] = (100, 512)
    rounds: int = 80
    # Seconds of rounds per concurrency over all pairs (bench.stats.Budget; data_plane.DataPlanePlan.seconds says
    # why): about what 80 rounds take on a quiet machine; a round against the peer counts as two.
    seconds: tuple[float, ...] = (30.0, 40.0)
    pairs: int = 4  # of side processes, one after the other (bench.data_plane.DataPlanePlan.pairs says why)
    live_heap_records: int = LIVE_HEAP_RECORDS


FULL_PLAN = FlagPlan()
# One pair of processes: the tracing rows start four per pair (ours and the peer's, on and off), and a quick run
# only shows that every row runs and reports.
QUICK_PLAN = FlagPlan(requests=(30, 128), rounds=2, pairs=1, live_heap_records=10_000)

TimedBlock = Callable[[Post, int, int, bool], Awaitable[Block]]


@dataclass(frozen=True)
class FlagCost:
    """One switch's benchmark: how to turn it on for the process, how to run one block with it on or off."""

    name: str  # "tracing": progress lines and the table's area
    measure: str  # "ServerClient.post traced / untraced"
    on_label: str  # "traced": in "+N µs CPU/req traced"
    module: str  # the benchmark's module, as bench.side_worker imports it: "bench.tracing_cost"
    install: Callable[[], None]
    timed_block: TimedBlock
    # concurrency -> minimum ratio: of on/off alone, or (run_against_peer) of ours over the peer's on/off
    goals: Mapping[int, float] = field(default_factory=dict)
    # The post each block makes, given the data server's port and whether the side is on (None: ServerClient.post
    # with rollout prefixes on), and what to close at the end: a peer's own raw aiohttp session.
    make_post: Callable[[int, bool], Post] | None = None
    close: Callable[[], Awaitable[None]] | None = None
    peer: FlagCost | None = None  # measured in the same rounds (run_against_peer); its module names it: "M:PEER"


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
    by_pair: list[list[float]] = field(default_factory=list)  # the ratios of each pair of side processes


async def interleaved(
    cost: FlagCost,
    on: SideWorker,
    off: SideWorker,
    result: Rounds,
    requests: int,
    rounds: int,
    budget: Budget = UNLIMITED,
) -> None:
    """bench.data_plane's `abba_rounds` of the switch on (A) against off (B), after a warm block of each, the
    collector left alone in each side: a side that keeps more objects alive (spans held until export) pays for
    the collections they cause. Added to `result` as one pair's rounds."""
    concurrency = result.concurrency

    async def block(side: SideWorker, requests: int) -> Block:
        return Block(*side.block(concurrency, requests))

    warm = max(requests, concurrency)
    await block(on, warm)
    await block(off, warm)
    ratios, on_blocks, off_blocks = await abba_rounds(
        lambda: block(on, requests), lambda: block(off, requests), rounds, budget
    )
    result.ratios += ratios
    result.on += on_blocks
    result.off += off_blocks
    result.by_pair.append(ratios)
    print(
        f"  {cost.name} c={concurrency}: per-round ratios {' '.join(f'{r:.2f}' for r in ratios)}", file=sys.stderr
    )


def row_of(cost: FlagCost, rounds: Rounds, heap: str, goal: float | None = None) -> Row:
    on_rps = median([b.requests_per_second for b in rounds.on])
    off_rps = median([b.requests_per_second for b in rounds.off])
    on_cpu = median([b.cpu_us_per_request for b in rounds.on])
    off_cpu = median([b.cpu_us_per_request for b in rounds.off])
    spread = spread_text(rounds.ratios, rounds.by_pair)
    return ratio_row(
        cost.name,
        f"{cost.measure}, concurrency {rounds.concurrency} "
        f"(req/s; GC on beside {heap} in each side's process; median of per-round ratios, {spread}; "
        f"+{on_cpu - off_cpu:.0f} µs CPU/req {cost.on_label})",
        f"on: {on_rps:.0f} req/s, {on_cpu:.0f} µs CPU/req",
        f"off: {off_rps:.0f} req/s, {off_cpu:.0f} µs CPU/req",
        median(rounds.ratios),
        goal,
    )


async def run(cost: FlagCost, port: int, plan: FlagPlan) -> list[Row]:
    """The cost's on/off rows; with a peer, `run_against_peer`'s."""
    if cost.peer is not None:
        return await run_against_peer(cost, cost.peer, port, plan)
    results = [Rounds(concurrency) for concurrency in plan.concurrencies]
    heap = ""
    for _ in range(plan.pairs):
        remaining = [
            (result, requests, seconds)
            for result, requests, seconds in zip(results, plan.requests, plan.seconds, strict=True)
            if not settled(result.ratios, result.by_pair)  # known well enough: no more pairs (bench.stats)
        ]
        if not remaining:
            break
        with side_pair(f"{cost.module}:on", f"{cost.module}:off", port, plan.live_heap_records) as (on, off):
            heap = on.heap
            for result, requests, seconds in remaining:
                await interleaved(
                    cost,
                    on,
                    off,
                    result,
                    requests,
                    rounds_per_pair(plan.rounds, plan.pairs),
                    pair_budget(seconds, plan.pairs),
                )
    return [row_of(cost, result, heap, cost.goals.get(result.concurrency)) for result in results]


async def against_peer_rounds(
    sides: tuple[SideWorker, SideWorker, SideWorker, SideWorker],
    ours: Rounds,
    theirs: Rounds,
    quotients: Rounds,
    requests: int,
    rounds: int,
    budget: Budget = UNLIMITED,
) -> None:
    """`rounds` rounds (fewer once the `budget` is spent), each one of ours (on against off) and one of the peer's,
    in turn first, each ABBA or BAAB in turn (so all four orders come round): a burst of load hits both comparisons
    of a round. Each round's quotient, our ratio over the peer's, goes to `quotients`."""
    concurrency = ours.concurrency

    def block(side: SideWorker) -> Callable[[], Awaitable[Block]]:
        async def timed() -> Block:
            return Block(*side.block(concurrency, requests))

        return timed

    on, off, peer_on, peer_off = (block(side) for side in sides)
    for warm in (on, off, peer_on, peer_off):
        await warm()
    comparisons = ((ours, on, off), (theirs, peer_on, peer_off))
    made: dict[int, list[float]] = {id(ours): [], id(theirs): [], id(quotients): []}  # this pair's ratios
    started = time.monotonic()
    for index in range(rounds):
        if budget.spent(index, started):
            break
        ratio_of: dict[int, float] = {}
        for result, side_on, side_off in comparisons if index % 2 == 0 else comparisons[::-1]:
            ratio, on_blocks, off_blocks = await one_round(side_on, side_off, (index // 2) % 2 == 0)
            result.ratios.append(ratio)
            result.on += on_blocks
            result.off += off_blocks
            made[id(result)].append(ratio)
            ratio_of[id(result)] = ratio
        quotient = ratio_of[id(ours)] / ratio_of[id(theirs)]
        quotients.ratios.append(quotient)
        made[id(quotients)].append(quotient)
    for result in (ours, theirs, quotients):
        result.by_pair.append(made[id(result)])
    print(
        f"  c={concurrency}: ours/peer per-round quotients {' '.join(f'{r:.2f}' for r in made[id(quotients)])}",
        file=sys.stderr,
    )


def quotient_row(cost: FlagCost, peer: FlagCost, ours: Rounds, theirs: Rounds, quotients: Rounds) -> Row:
    """Our on/off ratio over the peer's, the median of the per-round quotients, against the cost's goal."""
    spread = spread_text(quotients.ratios, quotients.by_pair)
    return ratio_row(
        cost.name,
        f"{cost.measure}, over {peer.measure}, concurrency {quotients.concurrency} (median of per-round quotients "
        f"of the two ratios, {spread})",
        f"gym_rpc {cost.on_label}/off: {median(ours.ratios):.2f}",
        f"peer {peer.on_label}/off: {median(theirs.ratios):.2f}",
        median(quotients.ratios),
        cost.goals.get(quotients.concurrency),
    )


async def run_against_peer(cost: FlagCost, peer: FlagCost, port: int, plan: FlagPlan) -> list[Row]:
    """`run` of `cost` and of `peer` in the same rounds (four processes alive per pair: ours on and off, the
    peer's on and off): each one's on/off row, then the quotient row that carries the goal."""
    ours = [Rounds(concurrency) for concurrency in plan.concurrencies]
    theirs = [Rounds(concurrency) for concurrency in plan.concurrencies]
    quotients = [Rounds(concurrency) for concurrency in plan.concurrencies]
    heap = ""
    share = rounds_per_pair(plan.rounds, plan.pairs)
    for _ in range(plan.pairs):
        # A concurrency takes no more pairs once its three rows are known well enough (bench.stats.settled).
        remaining = [
            index
            for index in range(len(plan.requests))
            if not all(settled(r.ratios, r.by_pair) for r in (ours[index], theirs[index], quotients[index]))
        ]
        if not remaining:
            break
        with (
            side_pair(f"{cost.module}:on", f"{cost.module}:off", port, plan.live_heap_records) as mine,
            side_pair(f"{peer.module}:on", f"{peer.module}:off", port, plan.live_heap_records) as peers,
        ):
            heap = mine[0].heap
            for index in remaining:
                requests = plan.requests[index]
                await against_peer_rounds(
                    (*mine, *peers),
                    ours[index],
                    theirs[index],
                    quotients[index],
                    requests,
                    share,
                    pair_budget(2 * plan.seconds[index], plan.pairs),
                )
    rows: list[Row] = []
    for mine_rounds, peer_rounds, quotient_rounds in zip(ours, theirs, quotients, strict=True):
        rows += [
            row_of(cost, mine_rounds, heap),
            row_of(peer, peer_rounds, heap),
            quotient_row(cost, peer, mine_rounds, peer_rounds, quotient_rounds),
        ]
    return rows


def main(cost: FlagCost, prog: str, doc: str | None, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--port", type=int, help="a running data server (python -m bench.servers data)")
    args = parser.parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.port is not None:
        rows = asyncio.run(run(cost, args.port, plan))
    else:
        with ServerProcess("data") as data:
            rows = asyncio.run(run(cost, int(data.info["port"]), plan))
    print("\n".join(table_lines(rows)))
    return 0
