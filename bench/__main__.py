"""`python -m bench` (what `make bench` runs): every benchmark, a ratio table on stdout, bench/RESULTS.md.

Progress goes to stderr. `--quick` runs tiny sizes in seconds (the smoke test uses it) and writes no file
unless `--out` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import (
    allocations,
    control_plane,
    data_plane,
    flag_cost,
    hot_path,
    isolation,
    memory,
    metrics_cost,
    relay_cost,
    replicas,
    report,
    tracing_cost,
    tracing_sampled_cost,
)
from bench.servers import ServerProcess, pinned_apart
from bench.stats import Row, table_lines

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
SECTIONS = (
    "data",
    "hotpath",
    "tracing",
    "metrics",
    "control",
    "relay",
    "isolation",
    "memory",
    *replicas.SECTIONS,
)
# Left out of `--quick` unless asked for (`--only`): tests/bench/test_bench_smoke.py runs each of these on its own.
QUICK_LEAVES_OUT = {"relay"}
# Loopback only: no proxy may divert a request, and no parent's config may stand in for the heads measured here.
_ENV_TO_DROP = ("http_proxy", "https_proxy", "all_proxy", "NEMO_GYM_CONFIG_DICT", "GYM_RPC_HEAD")


@dataclass(frozen=True)
class Plan:
    data: data_plane.DataPlanePlan
    allocations: allocations.AllocationPlan
    control: control_plane.ControlPlan
    isolation: isolation.IsolationPlan
    memory: memory.MemoryPlan
    replicas: replicas.ReplicasPlan
    relay: relay_cost.RelayPlan
    head_probe_interval: float
    head_probe_timeout: float
    quick: bool = False


FULL = Plan(
    data_plane.DataPlanePlan(),
    allocations.AllocationPlan(),
    control_plane.ControlPlan(),
    isolation.IsolationPlan(),
    memory.MemoryPlan(),
    replicas.ReplicasPlan(),
    relay_cost.RelayPlan(),
    head_probe_interval=2.0,
    head_probe_timeout=1.0,
)
QUICK = Plan(
    data_plane.QUICK_DATA_PLANE,
    allocations.QUICK_ALLOCATIONS,
    control_plane.QUICK_CONTROL,
    isolation.QUICK_ISOLATION,
    memory.QUICK_MEMORY,
    replicas.QUICK_REPLICAS,
    relay_cost.QUICK_RELAY,
    head_probe_interval=0.5,
    head_probe_timeout=0.2,
    quick=True,
)


def _clean_environment() -> None:
    for name in list(os.environ):
        if name.lower() in _ENV_TO_DROP or name in _ENV_TO_DROP:
            del os.environ[name]


def _progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


class Stopped(Exception):
    """SIGTERM (as `timeout` sends): the sections not yet run are left out, and the rows made are still written."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(f"stopped by signal {signum}")


@dataclass
class Collected:
    """The rows made so far. A section that fails leaves a row naming its error (its goal "runs", not met) and the
    others still run: a run of half an hour loses no finished section to a late one failing under load (the memory
    section's 10,000 connections once timed out at load 20, after 32 minutes of rows)."""

    rows: list[Row] = field(default_factory=list)
    stopped: bool = False

    def take(self, area: str, make: Callable[[], list[Row]]) -> None:
        if self.stopped:
            return
        try:
            self.rows += make()
        except Stopped as stop:
            self.stopped = True
            self.rows.append(Row(area, f"not finished: {stop}", "—", "—", math.nan, "runs", False))
        except Exception as error:  # reported in the table, not lost with the rows before it
            _progress(f"{area} failed: {error!r}")
            message = f"failed: {type(error).__name__}: {error}"[:300]
            self.rows.append(Row(area, message.replace("|", "/"), "—", "—", math.nan, "runs", False))

    @property
    def failed(self) -> bool:
        return any(row.goal_text == "runs" for row in self.rows)


def data_plane_rows(plan: Plan, sections: set[str], data_port: int, collected: Collected) -> None:
    """The rows that time ServerClient.post: client and data server pinned apart (`pinned_apart`)."""
    # Each switch's sides run in processes of their own (bench.side_worker): this process never turns one on.
    flag_plan = flag_cost.QUICK_PLAN if plan.quick else flag_cost.FULL_PLAN
    if "data" in sections:
        _progress("data plane")
        collected.take("data plane", lambda: asyncio.run(data_plane.run(data_port, plan.data)))
        _progress("data plane: objects a call keeps alive")
        collected.take("data plane", lambda: asyncio.run(allocations.run(data_port, plan.allocations)))
        collected.take(
            "data plane", lambda: [asyncio.run(allocations.inline_first_attempt_row(data_port, plan.allocations))]
        )
    if "hotpath" in sections:
        _progress("hot path: the speed trick of ServerClient.request")
        hot = plan.data
        collected.take(
            "hot path",
            lambda: asyncio.run(
                hot_path.run(data_port, hot.concurrencies[:2], hot.requests[:2], hot.rounds[:2], hot.seconds[:2])
            ),
        )
    if "tracing" in sections:
        _progress("tracing cost")
        collected.take("tracing", lambda: asyncio.run(flag_cost.run(tracing_cost.COST, data_port, flag_plan)))
        collected.take(
            "tracing", lambda: asyncio.run(flag_cost.run(tracing_sampled_cost.COST, data_port, flag_plan))
        )
    if "metrics" in sections:
        _progress("metrics cost")
        collected.take("metrics", lambda: asyncio.run(flag_cost.run(metrics_cost.COST, data_port, flag_plan)))


def run(plan: Plan, sections: set[str], collected: Collected | None = None) -> list[Row]:
    collected = Collected() if collected is None else collected
    with ServerProcess("data") as data:
        data_port = int(data.info["port"])
        if sections & {"data", "hotpath", "tracing", "metrics"}:
            with pinned_apart(data.pid):
                data_plane_rows(plan, sections, data_port, collected)
        if sections & {"control", "isolation"} and not collected.stopped:
            control_args = [
                f"--servers={plan.control.servers}",
                f"--silent={plan.control.silent}",
                f"--probe-interval={plan.head_probe_interval}",
                f"--probe-timeout={plan.head_probe_timeout}",
            ]
            with ServerProcess("control", *control_args) as control:
                if "control" in sections:
                    _progress("control plane")
                    collected.take("control plane", lambda: control_plane.run(control.info, plan.control))
                if "isolation" in sections:
                    _progress("isolation")
                    head = f"127.0.0.1:{control.info['head_a']}"
                    name = str(control.info["names_a"][0])
                    collected.take(
                        "isolation", lambda: asyncio.run(isolation.run(data_port, head, name, plan.isolation))
                    )
        if "relay" in sections:
            _progress("control plane: the per-address relay on the gRPC port, with and without")
            collected.take("control plane", lambda: relay_cost.rows(plan.relay))
        if "memory" in sections:
            _progress("memory")
            collected.take("memory", lambda: memory.import_rows(plan.memory))
            collected.take("memory", lambda: memory.in_flight_rows(data_port, plan.memory))
    collected.take("replicas", lambda: replicas.rows(plan.replicas, sections))
    return collected.rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every benchmark")
    parser.add_argument(
        "--out", type=Path, help=f"where to write the results (default: {RESULTS_PATH}, none with --quick)"
    )
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    sections = set(args.only.split(",")) if args.only else set(SECTIONS)
    if args.quick and not args.only:
        sections -= QUICK_LEAVES_OUT
    if not sections <= set(SECTIONS):
        parser.error(f"--only takes {','.join(SECTIONS)}")
    _clean_environment()
    started = time.monotonic()
    collected = Collected()
    signal.signal(signal.SIGTERM, _stop)
    try:
        run(QUICK if args.quick else FULL, sections, collected)
    except Stopped as stop:  # between sections: the rows made are written
        collected.rows.append(Row("bench", f"not finished: {stop}", "—", "—", math.nan, "runs", False))
    rows = collected.rows
    elapsed = time.monotonic() - started
    print("\n".join(table_lines(rows)))
    print(report.summary_line(rows))
    out = args.out or (None if args.quick else RESULTS_PATH)
    if out is not None:
        report.write(out, rows, elapsed, args.quick)
        _progress(f"wrote {out} ({elapsed:.0f} s)")
    return 1 if collected.failed else 0


if __name__ == "__main__":
    sys.exit(main())
