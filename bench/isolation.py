"""Isolation: control calls while the data-plane pool is saturated by slow requests.

The client's data pool is capped (`http_client.max_connections`) and kept full by many more slow requests than
it has connections; meanwhile control calls run back to back in the same event loop: gRPC `GetServerStatus` with
`max_age`, gRPC `ListServerStatuses`, and a `_control=True` HTTP call (the reserved aiohttp pool). The baseline is
NeMo Gym's situation, one shared pool: the same HTTP call without `_control`, which waits for a free data
connection. Idle figures (no saturation) are measured first in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bench.data_plane import SERVER_NAME, make_client
from bench.stats import Row, Samples, fmt_ms
from gym_rpc.client.control._channel import close_aio_channels
from gym_rpc.client.control._clients import ControlClient
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient

AREA = "isolation"
GOAL_P99_MS = 50.0

Call = Callable[[], Awaitable[object]]


@dataclass(frozen=True)
class IsolationPlan:
    pool_size: int = 32
    saturating_requests: int = 256  # in flight at once: 8x the pool
    slow_seconds: float = 0.25
    window_seconds: float = 6.0
    idle_samples: int = 100
    baseline_timeout_seconds: float = 5.0


QUICK_ISOLATION = IsolationPlan(saturating_requests=64, slow_seconds=0.2, window_seconds=0.8, idle_samples=10)


async def _get(client: ServerClient, control: bool) -> None:
    async with await client.request(SERVER_NAME, "/", "GET", _control=control) as response:
        await response.read()


async def _sample(call: Call, samples: Samples) -> None:
    started = time.perf_counter()
    await call()
    samples.values.append(time.perf_counter() - started)


async def _saturate(client: ServerClient, plan: IsolationPlan, completed: list[int]) -> None:
    """Keep `saturating_requests` slow requests in flight until cancelled."""

    async def worker() -> None:
        while True:
            async with await client.post(SERVER_NAME, f"/slow?seconds={plan.slow_seconds}", json={}) as response:
                await response.read()
            completed[0] += 1

    await asyncio.gather(*(worker() for _ in range(plan.saturating_requests)))


async def _shared_pool_baseline(client: ServerClient, plan: IsolationPlan, samples: Samples) -> None:
    """The same HTTP call over the saturated data pool, back to back until cancelled."""
    while True:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(_get(client, control=False), plan.baseline_timeout_seconds)
        except TimeoutError:
            pass  # its wait so far is a lower bound, and counts
        except asyncio.CancelledError:  # the window ended: the same
            samples.values.append(time.perf_counter() - started)
            raise
        samples.values.append(time.perf_counter() - started)


async def _cancel(*tasks: asyncio.Task[None]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def measure(client: ServerClient, head_address: str, status_name: str, plan: IsolationPlan) -> list[Row]:
    control = ControlClient(head_address)
    calls: dict[str, Call] = {
        "gRPC GetServerStatus (max_age 5 s)": lambda: control.get_server_status(status_name, max_age_seconds=5.0),
        "gRPC ListServerStatuses": control.list_server_statuses,
        "HTTP call with _control=True": lambda: _get(client, control=True),
    }
    idle = {label: Samples() for label in calls}
    for call in calls.values():
        await call()  # warm: channel and connections
    for _ in range(plan.idle_samples):
        for label, call in calls.items():
            await _sample(call, idle[label])

    completed = [0]
    saturation = asyncio.create_task(_saturate(client, plan, completed))
    await asyncio.sleep(plan.slow_seconds / 2)  # every data connection taken, a queue behind them
    baseline = Samples()
    baseline_task = asyncio.create_task(_shared_pool_baseline(client, plan, baseline))
    busy = {label: Samples() for label in calls}
    deadline = time.monotonic() + plan.window_seconds
    try:
        while time.monotonic() < deadline:
            for label, call in calls.items():
                await _sample(call, busy[label])
            await asyncio.sleep(0.002)
    finally:
        await _cancel(saturation, baseline_task)
    print(f"  isolation: {completed[0]} slow requests completed while sampling", file=sys.stderr)
    rows = []
    for label in calls:
        ours, calm = busy[label], idle[label]
        rows.append(
            Row(
                AREA,
                f"{label} while the data pool ({plan.pool_size} connections) is saturated "
                f"(n={len(ours.values)}; idle: {calm.describe()})",
                ours.describe(),
                f"HTTP call sharing the data pool (NeMo Gym), n={len(baseline.values)}: {baseline.describe()}",
                baseline.p99_ms / ours.p99_ms,
                f"p99 < {GOAL_P99_MS:.0f} ms",
                ours.p99_ms < GOAL_P99_MS,
            )
        )
    return rows


async def run(data_port: int, head_address: str, status_name: str, plan: IsolationPlan) -> list[Row]:
    client = make_client(data_port, http_client={"max_connections": plan.pool_size})
    try:
        return await measure(client, head_address, status_name, plan)
    finally:
        with contextlib.suppress(Exception):
            await close_aio_channels()
        await close_http_sessions()


def describe_plan(plan: IsolationPlan) -> str:
    return (
        f"{plan.saturating_requests} requests of {fmt_ms(plan.slow_seconds * 1e3)} ms kept in flight over a "
        f"{plan.pool_size}-connection data pool for {plan.window_seconds:g} s"
    )
