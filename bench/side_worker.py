"""One side of the data-plane comparison in a process of its own, as a rollout worker runs: its own live heap and
its own garbage collector.

In one process the two sides share the collector: a full collection (of the live heap, about as long as a block at
512 calls in flight) is paid by whichever block crosses its threshold, whoever's objects piled up towards it, so a
round's ratio swung between about 0.5 and 2 and the median of such ratios told little. In a process of its own each
side pays for exactly the collections its own objects cause. The parent still interleaves the two processes' blocks
(ABBA), one at a time, so a burst of load from elsewhere hits both sides of a round.

    python -m bench.side_worker ours|raw|MODULE:on|MODULE:off PORT HEAP_RECORDS

`MODULE:on` and `MODULE:off` are the two sides of a switch's cost (bench.flag_cost: MODULE is the benchmark, as
`bench.tracing_cost`, whose `COST` says what to run; `MODULE:NAME:on` names another of its costs, as
`bench.tracing_peer:EVERY_CALL`): `ServerClient.post` (or the cost's own post) with the switch on in every block,
or off in every block.

prints `ready {"heap": ...}`, then answers each line `CONCURRENCY REQUESTS` on stdin with one JSON line: requests
per second, client CPU µs per request, the collector's runs per 10k requests by generation. It ends with its input.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import select
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.data_plane import Block

REPO_ROOT = Path(__file__).resolve().parent.parent
SIDES = ("ours", "raw")
READY = "ready "
_START_SECONDS = 120.0  # import, a live heap of a few hundred thousand dicts, a client
_BLOCK_SECONDS = 300.0  # far beyond any block: a stuck side fails the bench instead of hanging it


class SideWorker:
    """The parent's handle on one side's process: `block` runs one timed block there and returns its figures.
    Started at once; `wait_ready` waits until its heap and client are made."""

    def __init__(self, side: str, port: int, heap_records: int) -> None:
        if side not in SIDES and not side.endswith((":on", ":off")):
            raise ValueError(f"side must be one of {SIDES} or MODULE:on|off, not {side!r}")
        self.side = side
        self.heap = ""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.side_worker", side, str(port), str(heap_records)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )

    def wait_ready(self) -> None:
        ready = self._line(_START_SECONDS)
        if not ready.startswith(READY):
            raise RuntimeError(f"the {self.side} side did not start: {ready!r}")
        self.heap = json.loads(ready[len(READY) :])["heap"]

    def block(self, concurrency: int, requests: int) -> tuple[float, float, tuple[float, ...]]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{concurrency} {requests}\n")
        self.process.stdin.flush()
        rps, cpu_us, collections = json.loads(self._line(_BLOCK_SECONDS))
        return rps, cpu_us, tuple(collections)

    def _line(self, timeout: float) -> str:
        stdout = self.process.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], timeout)
        line = stdout.readline() if readable else ""
        if not line:
            raise RuntimeError(
                f"the {self.side} side sent nothing within {timeout:.0f} s (exit {self.process.poll()})"
            )
        return line

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()


def rounds_per_pair(rounds: int, pairs: int) -> int:
    """Each pair's share of a row's `rounds`, rounded up: never none (`python -m bench.data_plane --rounds 2`)."""
    return -(-rounds // pairs)


@contextlib.contextmanager
def side_pair(side_a: str, side_b: str, port: int, heap_records: int) -> Iterator[tuple[SideWorker, SideWorker]]:
    """The two sides' processes, started side by side (each builds its heap meanwhile), stopped at the end.

    A process has a speed of its own, which no number of its rounds averages away: where its memory landed and its
    hash seed make every block it runs a few percent faster or slower. Two processes of the same side, each
    comparison's rounds tightly about its figure, read 0.99, 1.04 and 1.00 of each other. So a row's rounds are
    spread over several pairs, one after the other (DataPlanePlan.pairs), and the spread of the pairs' medians
    shows how much that moved them."""
    workers = (SideWorker(side_a, port, heap_records), SideWorker(side_b, port, heap_records))
    try:
        for worker in workers:
            worker.wait_ready()
        yield workers
    finally:
        for worker in workers:
            worker.close()


def _switch_block(
    side: str, port: int
) -> tuple[Callable[[int, int], Awaitable[Block]], Callable[[], Awaitable[None]]]:
    """A block of `MODULE[:NAME]:on|off`, and what to close at the end: the switch's benchmark installs what "on"
    needs (an SDK provider, say) in this process, as in a worker, and runs every block with the switch as the side
    says."""
    from bench.data_plane import make_client, ours_post

    target, _, state = side.rpartition(":")
    module, _, name = target.partition(":")
    cost = getattr(importlib.import_module(module), name or "COST")
    on = state == "on"
    cost.install()
    if cost.make_post is not None:
        post = cost.make_post(port, on)
    else:
        post = ours_post(make_client(port, observability_enabled=True))  # rollout prefixes on, as observed runs
    timed_block = functools.partial(cost.timed_block, post)
    return lambda concurrency, requests: timed_block(requests, concurrency, on), cost.close or _nothing


async def _nothing() -> None:
    return None


async def _serve(side: str, port: int, heap_records: int) -> None:
    from bench.data_plane import PATH, make_client, ours_post, raw_post, raw_session, rollout_buffers, run_block
    from gym_rpc.client.data._http import close_http_sessions

    heap = rollout_buffers(heap_records)  # alive until the end: every full collection scans it
    session = raw_session() if side == "raw" else None
    close: Callable[[], Awaitable[None]] = _nothing
    timed_block: Callable[[int, int], Awaitable[Block]]
    if side in SIDES:
        post = raw_post(session, f"http://127.0.0.1:{port}{PATH}") if session else ours_post(make_client(port))

        def timed_block(concurrency: int, requests: int) -> Awaitable[Block]:
            return run_block(post, requests, concurrency)
    else:
        timed_block, close = _switch_block(side, port)
    print(READY + json.dumps({"heap": heap.describe()}), flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            concurrency, requests = (int(word) for word in line.split())
            block = await timed_block(concurrency, requests)
            figures = (block.requests_per_second, block.cpu_us_per_request, block.collections_per_10k)
            print(json.dumps(figures), flush=True)
    finally:
        if session is not None:
            await session.close()
        await close()
        await close_http_sessions()


def main(argv: list[str]) -> int:
    side, port, heap_records = argv
    asyncio.run(_serve(side, int(port), int(heap_records)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
