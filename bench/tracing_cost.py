"""What tracing costs a rollout worker: `ServerClient.post` requests per second with tracing on over the same with
tracing off, both measured in the same process against the same data server, in interleaved blocks (on/off,
off/on, ...), the figure being the median of the per-round ratios.

"On" is what a traced worker runs: the SDK's TracerProvider with a batching processor (its exporter drops the
spans, so the network cost of exporting is left out), each call a CLIENT span, child of the rollout's span, whose
context goes out in the `traceparent` header. "Off" is the untraced path. Tracing is a per-process decision that
never turns off again, so this benchmark flips gym_rpc's flag between blocks itself, and runs in a process of its
own (`rows_in_subprocess`) so that nothing of it leaks into the other benchmarks.

`python -m bench.tracing_cost [--quick] [--port PORT]` prints the table (it starts a data server when no port is
given); `--json` prints the rows as JSON instead, for `rows_in_subprocess`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from opentelemetry import trace

from bench.data_plane import Block, Post, make_client, ours_post, run_block
from bench.servers import REPO_ROOT, ServerProcess
from bench.stats import Row, median, ratio_row, table_lines
from gym_rpc.client._http import close_http_sessions
from gym_rpc.client._rollout import rollout_context
from gym_rpc.telemetry import TRACING, setup_tracing


@dataclass(frozen=True)
class TracingPlan:
    concurrencies: tuple[int, ...] = (1, 64)
    requests: tuple[int, ...] = (2000, 6000)
    rounds: int = 5


QUICK_TRACING = TracingPlan(requests=(60, 200), rounds=2)


@dataclass
class Rounds:
    concurrency: int
    ratios: list[float] = field(default_factory=list)
    on: list[Block] = field(default_factory=list)
    off: list[Block] = field(default_factory=list)


def install_sdk_provider() -> None:
    """The SDK's provider, batching into an exporter that drops what it gets; then tracing decided on."""
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class DroppingExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))
    trace.set_tracer_provider(provider)
    setup_tracing(observability_enabled=True)


@contextmanager
def tracing(on: bool) -> Iterator[None]:
    """gym_rpc's tracing flag for one block (benchmark only: a process never turns tracing off)."""
    previous = TRACING.enabled
    TRACING.enabled = on
    try:
        yield
    finally:
        TRACING.enabled = previous


async def timed_block(post: Post, requests: int, concurrency: int, on: bool) -> Block:
    """One block inside a rollout (its id bound, and, when traced, its span current), as a worker runs it."""
    with tracing(on), rollout_context("bench-rollout"):
        if not on:
            return await run_block(post, requests, concurrency)
        with trace.get_tracer("bench").start_as_current_span("rollout"):
            return await run_block(post, requests, concurrency)


async def interleaved(post: Post, concurrency: int, requests: int, rounds: int) -> Rounds:
    warm = max(requests // 4, concurrency)
    await timed_block(post, warm, concurrency, on=True)
    await timed_block(post, warm, concurrency, on=False)
    result = Rounds(concurrency)
    for index in range(rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        blocks = {on: await timed_block(post, requests, concurrency, on) for on in order}
        result.on.append(blocks[True])
        result.off.append(blocks[False])
        result.ratios.append(blocks[True].requests_per_second / blocks[False].requests_per_second)
        on_rps, off_rps = blocks[True].requests_per_second, blocks[False].requests_per_second
        print(
            f"  tracing c={concurrency} round {index + 1}/{rounds}: on {on_rps:.0f} rps, off {off_rps:.0f} rps, "
            f"ratio {result.ratios[-1]:.3f}",
            file=sys.stderr,
        )
    return result


def row_of(rounds: Rounds) -> Row:
    on_rps = median([b.requests_per_second for b in rounds.on])
    off_rps = median([b.requests_per_second for b in rounds.off])
    on_cpu = median([b.cpu_us_per_request for b in rounds.on])
    off_cpu = median([b.cpu_us_per_request for b in rounds.off])
    spread = f"rounds {min(rounds.ratios):.2f} to {max(rounds.ratios):.2f}"
    return ratio_row(
        "tracing",
        f"ServerClient.post traced / untraced, concurrency {rounds.concurrency} "
        f"(req/s; median of per-round ratios, {spread}; +{on_cpu - off_cpu:.0f} µs CPU/req traced)",
        f"on: {on_rps:.0f} req/s, {on_cpu:.0f} µs CPU/req",
        f"off: {off_rps:.0f} req/s, {off_cpu:.0f} µs CPU/req",
        median(rounds.ratios),
        None,
    )


async def run(port: int, plan: TracingPlan) -> list[Row]:
    install_sdk_provider()
    client = make_client(port, observability_enabled=True)  # rollout prefixes on, as traced deployments run
    post = ours_post(client)
    rows: list[Row] = []
    try:
        for concurrency, requests in zip(plan.concurrencies, plan.requests, strict=True):
            rows.append(row_of(await interleaved(post, concurrency, requests, plan.rounds)))
    finally:
        await close_http_sessions()
    return rows


def rows_in_subprocess(port: int, quick: bool = False) -> list[Row]:
    """Run this benchmark in a fresh interpreter (tracing state is per process) against the data server on
    `port`; its rows. For `python -m bench`: `rows += tracing_cost.rows_in_subprocess(data_port, quick)`."""
    command = [sys.executable, "-m", "bench.tracing_cost", f"--port={port}", "--json"]
    completed = subprocess.run(
        [*command, *(["--quick"] if quick else [])],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        timeout=600,
        check=True,
    )
    return [Row(**fields) for fields in json.loads(completed.stdout)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing_cost", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--port", type=int, help="a running data server (python -m bench.servers data)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    plan = QUICK_TRACING if args.quick else TracingPlan()
    if args.port is not None:
        rows = asyncio.run(run(args.port, plan))
    else:
        with ServerProcess("data") as data:
            rows = asyncio.run(run(int(data.info["port"]), plan))
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows]))
    else:
        print("\n".join(table_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
