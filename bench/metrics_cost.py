"""What worker metrics cost: `ServerClient.post` requests per second with metrics on over the same with metrics
off, in one process against the same data server, interleaved blocks, median of the per-round ratios.

"On" is the SDK's MeterProvider with a reader that collects only when asked (as Prometheus scrapes), each call
recording its duration, in-flight count and outcome. "Off" is the plain path, whose only cost is the boolean
check in `ServerClient.request` (the data-plane rows of `make bench` measure that path against raw aiohttp).
Like tracing_cost, this flips gym_rpc's flag between blocks and runs in a process of its own.

`python -m bench.metrics_cost [--quick] [--port PORT] [--json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from bench.data_plane import Block, Post, make_client, ours_post, run_block
from bench.servers import REPO_ROOT, ServerProcess
from bench.stats import Row, median, ratio_row, table_lines
from bench.tracing_cost import QUICK_TRACING, Rounds, TracingPlan
from gym_rpc.client._http import close_http_sessions
from gym_rpc.client._rollout import rollout_context
from gym_rpc.metrics import METRICS, enable_client_metrics


def install_sdk_provider() -> None:
    """The SDK's provider as gym_rpc installs it (no exemplars), with a reader that collects when asked."""
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()], exemplar_filter=AlwaysOffExemplarFilter())
    metrics.set_meter_provider(provider)
    enable_client_metrics()


@contextmanager
def metering(on: bool) -> Iterator[None]:
    previous = METRICS.enabled
    METRICS.enabled = on
    try:
        yield
    finally:
        METRICS.enabled = previous


async def timed_block(post: Post, requests: int, concurrency: int, on: bool) -> Block:
    with metering(on), rollout_context("bench-rollout"):
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
            f"  metrics c={concurrency} round {index + 1}/{rounds}: on {on_rps:.0f} rps, off {off_rps:.0f} rps, "
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
        "metrics",
        f"ServerClient.post with worker metrics / without, concurrency {rounds.concurrency} "
        f"(req/s; median of per-round ratios, {spread}; +{on_cpu - off_cpu:.0f} µs CPU/req measured)",
        f"on: {on_rps:.0f} req/s, {on_cpu:.0f} µs CPU/req",
        f"off: {off_rps:.0f} req/s, {off_cpu:.0f} µs CPU/req",
        median(rounds.ratios),
        None,
    )


async def run(port: int, plan: TracingPlan) -> list[Row]:
    install_sdk_provider()
    client = make_client(port, observability_enabled=True)
    post = ours_post(client)
    rows: list[Row] = []
    try:
        for concurrency, requests in zip(plan.concurrencies, plan.requests, strict=True):
            rows.append(row_of(await interleaved(post, concurrency, requests, plan.rounds)))
    finally:
        await close_http_sessions()
    return rows


def rows_in_subprocess(port: int, quick: bool = False) -> list[Row]:
    """This benchmark in a fresh interpreter (the MeterProvider is per process) against the data server."""
    command = [sys.executable, "-m", "bench.metrics_cost", f"--port={port}", "--json"]
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
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_cost", description=__doc__)
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
