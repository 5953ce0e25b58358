"""Memory: resident set size after importing the client module, and peak RSS with 10,000 data-plane requests in
flight, ServerClient against raw aiohttp. Each figure comes from a fresh interpreter (`python -m bench.memory`),
since a process's peak RSS (VmHWM) only ever rises.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.servers import REPO_ROOT
from bench.stats import Row, median, ratio_row

AREA = "memory"
IMPORT_RSS_GOAL_MB = 45.0  # issue 28's goal on this machine
NEMO_GYM_IMPORT_RSS_MB = 101.0  # DESIGN.md: NeMo Gym 0.7.0's client module, measured on a machine like this one


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set (VmRSS) or its peak (VmHWM), in MB, from /proc (Linux)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


# --- children ----------------------------------------------------------------------------------------------------


async def in_flight_child(mode: str, port: int, requests: int, hold: float, connections: int) -> dict[str, Any]:
    """`requests` calls started at once against a server that holds each for `hold` seconds."""
    from bench.data_plane import PAYLOAD, SERVER_NAME, make_client, raw_session
    from gym_rpc.client.data._http import close_http_sessions

    path = f"/slow?seconds={hold}"
    client = make_client(port, http_client={"max_connections": connections, "connect_timeout_seconds": 60})
    raw = raw_session(limit=connections) if mode == "raw" else None
    in_flight = peak = 0

    async def one() -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            if raw is not None:
                async with raw.post(f"http://127.0.0.1:{port}{path}", json=PAYLOAD) as response:
                    await response.read()
            else:
                async with await client.post(SERVER_NAME, path, json=PAYLOAD) as response:
                    await response.read()
        finally:
            in_flight -= 1

    if raw is not None:  # both sides start from a session with one connection made
        async with raw.get(f"http://127.0.0.1:{port}/") as response:
            await response.read()
    else:
        async with await client.get(SERVER_NAME, "/") as response:
            await response.read()
    before = rss_mb()
    started = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(requests)), return_exceptions=True)
    seconds = time.perf_counter() - started
    failures = [r for r in results if isinstance(r, BaseException)]
    if raw is not None:
        await raw.close()
    await close_http_sessions()
    return {
        "rss_before_mb": before,
        "peak_rss_mb": rss_mb("VmHWM"),
        "seconds": seconds,
        "peak_in_flight": peak,
        "failures": len(failures),
        "first_failure": repr(failures[0]) if failures else "",
    }


# --- parent ------------------------------------------------------------------------------------------------------


def _child(*args: str, timeout: float = 120.0) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.memory", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@dataclass(frozen=True)
class MemoryPlan:
    requests: int = 10_000
    hold_seconds: float = 1.0
    connections: int = 10_000  # every request holds its own connection at the server: truly in flight
    rounds: int = 2
    import_rounds: int = 3


QUICK_MEMORY = MemoryPlan(requests=300, hold_seconds=0.1, connections=300, rounds=1, import_rounds=1)


_RSS_AFTER_IMPORT = """
import sys
if sys.argv[1]:
    __import__(sys.argv[1])
with open("/proc/self/status", encoding="ascii") as status:
    print(next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024)
"""


def rss_after_import(module: str) -> float:
    """VmRSS (MB) of a fresh interpreter that imported only `module` ("" for none): no bench code loaded."""
    done = subprocess.run(
        [sys.executable, "-c", _RSS_AFTER_IMPORT, module],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return float(done.stdout.strip())


def import_rows(plan: MemoryPlan) -> list[Row]:
    def rss_after(module: str) -> float:
        return median([rss_after_import(module) for _ in range(plan.import_rounds)])

    bare, aiohttp_only, ours = rss_after(""), rss_after("aiohttp"), rss_after("gym_rpc.client.server_client")
    return [
        Row(
            AREA,
            f"RSS after `import gym_rpc.client.server_client` (bare interpreter {bare:.0f} MB, `import aiohttp` "
            f"{aiohttp_only:.0f} MB: the data plane imports it on its first call; median of {plan.import_rounds})",
            f"{ours:.0f} MB",
            f"NeMo Gym's client module: {NEMO_GYM_IMPORT_RSS_MB:.0f} MB (DESIGN, not measured here)",
            NEMO_GYM_IMPORT_RSS_MB / ours,
            f"≤ {IMPORT_RSS_GOAL_MB:.0f} MB",
            ours <= IMPORT_RSS_GOAL_MB,
        )
    ]


def in_flight_rows(port: int, plan: MemoryPlan) -> list[Row]:
    args = [str(port), str(plan.requests), str(plan.hold_seconds), str(plan.connections)]
    runs: dict[str, list[dict[str, Any]]] = {"gym": [], "raw": []}
    for index in range(plan.rounds):
        for mode in ("gym", "raw") if index % 2 == 0 else ("raw", "gym"):
            result = _child("in-flight", mode, *args)
            if result["failures"]:
                raise RuntimeError(
                    f"memory bench ({mode}): {result['failures']} failed: {result['first_failure']}"
                )
            runs[mode].append(result)
            print(
                f"  memory {mode}: peak {result['peak_rss_mb']:.0f} MB, {result['peak_in_flight']} in flight, "
                f"{result['seconds']:.1f} s",
                file=sys.stderr,
            )

    def peak(mode: str) -> float:
        return median([r["peak_rss_mb"] for r in runs[mode]])

    def growth(mode: str) -> float:
        return median([r["peak_rss_mb"] - r["rss_before_mb"] for r in runs[mode]])

    return [
        ratio_row(
            AREA,
            f"peak RSS with {plan.requests:,} POST /v1/responses in flight ({plan.connections:,} connections, "
            f"server holds each {plan.hold_seconds:g} s; ratio: raw / ours)",
            f"{peak('gym'):.0f} MB (+{growth('gym'):.0f} MB while in flight)",
            f"raw aiohttp: {peak('raw'):.0f} MB (+{growth('raw'):.0f} MB)",
            peak("raw") / peak("gym"),
            None,
        )
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory")
    commands = parser.add_subparsers(dest="command", required=True)
    flight = commands.add_parser("in-flight")
    flight.add_argument("mode", choices=["gym", "raw"])
    flight.add_argument("port", type=int)
    flight.add_argument("requests", type=int)
    flight.add_argument("hold", type=float)
    flight.add_argument("connections", type=int)
    args = parser.parse_args(argv)
    result = asyncio.run(in_flight_child(args.mode, args.port, args.requests, args.hold, args.connections))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
