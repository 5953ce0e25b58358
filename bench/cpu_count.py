"""Client CPU per request as a count of instructions (issue 41: "our CPU per request stays within 2 % of raw
aiohttp's"). Timed CPU per request on two shared cores scatters by more than 2 % from round to round (the
data-plane rows' middle halves span 0.92-1.12); the instructions a process executes do not depend on the load.

A client process runs under valgrind's callgrind, which counts every instruction it executes in user space (the
interpreter, aiohttp, orjson, libc; not the kernel's work for its system calls, the same on every side). The data
server runs natively in a process of its own (`python -m bench.servers data`, as for the data-plane rows). The
client warms every side up with a window's worth of calls (its connection, caches, the client's data plane, the
URLs of every rollout a window uses), collects and freezes its heap, then counts one side at a time:
`os.getppid()` opens a window (callgrind's `--zero-before=os_getppid` zeroes the count) and `os.getpgrp()` closes
it (`--dump-before=os_getpgrp` writes it), so start-up, imports and warm-up are left out. A window is REQUESTS
sequential calls (one in flight) of the data-plane rows' ~1 KB `POST /v1/responses`, each answer read with
`orjson.loads`, right after a rollout's calls that keep the side's pooled connection fresh (the other windows
outlast aiohttp's 15 s keep-alive under valgrind). The sides:

* raw: raw aiohttp + orjson as a careful user writes it, the data-plane rows' baseline (bench.data_plane
  `raw_post`: `session.post(url, data=orjson.dumps(body))` with a JSON Content-Type, on a session with gym_rpc's
  pool limits and deadline and no cookie jar);
* raw_lean: the leanest call aiohttp takes, the one gym_rpc's pipeline makes (`await session.request("POST", url,
  data=BytesPayload(orjson.dumps(body), content_type=...))`, no header mapping to merge): ours over it is what
  the pipeline itself costs;
* ours: `ServerClient.post(name, "/v1/responses", json=body)`, a server of one instance (bench.data_plane
  `ours_post`);
* ours_rollouts: the same inside `rollout_context(id)`, a new rollout every 8 calls (observability off, the
  default: the call does not read the id);
* raw_observed and ours_observed: observability on, rollouts of 8 calls; ours sends each call to
  `/ng-rollout/<id>/v1/responses` (NeMo Gym's rule), raw aiohttp posts to the same URL, built once per rollout.

What else could move a count, and what holds it still:

* String hashes, and so dict and set layouts: PYTHONHASHSEED=0 in every client process.
* The collector: left on (its young collections are part of a call's cost) over a heap frozen after the warm-up
  (`gc.freeze()`), so no full collection of the import-time heap falls into one side's window by chance; each
  window's collections are reported (none ran in 400 calls: a sequential call frees what it makes).
* A follower thread: the clients follow no head (`follow_instances(False)`); the bench's head (port 1) never
  answers, and its retries would land in whichever window they fall in.
* The event loop's waits (`epoll_wait`): when the server's answer lands decides whether a call waits 3 or 4 times,
  each wait 13,000-15,000 instructions (asyncio's `_run_once` and its selector). Windows of one side ran 3.1-3.8
  waits per call and differed by up to 1.5 % in their counts; that is their whole scatter. So each window's waits
  are counted (calls of `epoll_wait` in its dump) and the figure that judges is the count at the run's mean waits
  per call: each window's count less the cost of its waits beyond the mean (the cost per wait fitted over all
  windows of the run, within each side). The waits per call of each side are shown: a client that made the loop
  wait more often per call would show it there.

Each repeat is a process of its own running ROUNDS windows of every side (each round's order rotated); a row's
ratio is the median of the processes' ratios at equal waits, shown with their range and the ratio of the counts
as counted.

    python -m bench.cpu_count [--requests 400] [--rounds 3] [--repeats 3] [--keep DIR] [--out bench/CPU_COUNT.md]

`--keep DIR` keeps each window's dump (DIR/PROCESS/N-SIDE.callgrind) for `callgrind_annotate`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, median

import aiohttp
import orjson

from bench.stats import Row, table_lines

REPO_ROOT = Path(__file__).resolve().parent.parent
AREA = "data plane"
ZERO_MARKER = "os_getppid"  # CPython's C function behind os.getppid(): nothing else in the client calls it
DUMP_MARKER = "os_getpgrp"  # behind os.getpgrp()
WAIT_FUNCTION = "epoll_wait"  # libc's: one call per wait of the event loop's selector
ROLLOUT_CALLS = 8  # calls per rollout in the rollout sides (as the tracing rows' rollouts)
GOAL = 1.02  # ours / raw instructions per request, at most (issue 41 point 2)
HASH_SEED = "0"
# Loopback only: no proxy may divert a request, and no parent's config may stand in for the client's.
_ENV_TO_DROP = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "nemo_gym_config_dict", "gym_rpc_head")

Run = Callable[[int], Awaitable[None]]


@dataclass(frozen=True)
class Comparison:
    """One row: our side against its baseline (`goal`: the most ours / raw may be; None: the row informs)."""

    ours: str
    raw: str
    measure: str
    baseline: str
    goal: float | None = GOAL


SIDES = ("raw", "raw_lean", "ours", "ours_rollouts", "raw_observed", "ours_observed")
RAW = "raw aiohttp + orjson"
COMPARISONS = (
    Comparison("ours", "raw", f"ServerClient.post(json=) vs {RAW}", RAW),
    Comparison(
        "ours_rollouts",
        "raw",
        f"ServerClient.post(json=) inside rollout_context(id) (a rollout of {ROLLOUT_CALLS} calls; observability "
        f"off) vs {RAW}",
        RAW,
    ),
    Comparison(
        "ours_observed",
        "raw_observed",
        f"ServerClient.post(json=) with observability on, in rollouts of {ROLLOUT_CALLS} calls (path "
        f"/ng-rollout/<id>/v1/responses) vs {RAW} to the same URL, built once per rollout",
        f"{RAW}, same URL",
    ),
    Comparison(
        "ours",
        "raw_lean",
        "ServerClient.post(json=) vs the leanest raw aiohttp call, the one its pipeline makes (await "
        "session.request('POST', url, data=BytesPayload(orjson.dumps(body))), no headers to merge): what the "
        "pipeline itself costs",
        "aiohttp session.request + BytesPayload",
        None,
    ),
)


@dataclass(frozen=True)
class CountPlan:
    requests: int = 400  # per window: a multiple of ROLLOUT_CALLS
    # Calls per side before the windows: a window's worth, so every rollout id a window uses has been seen (yarl's
    # URL cache, the rollout prefix cache) and no window pays a first parse that another side's window spared.
    warmup: int = 400
    rounds: int = 3  # windows per side in each process
    repeats: int = 3  # processes
    timeout: float = 900.0  # per client process under valgrind (about 50x slower than natively): a hang guard

    def command(self) -> str:
        return (
            f"python -m bench.cpu_count --requests {self.requests} --rounds {self.rounds} --repeats {self.repeats}"
        )


QUICK_COUNT = CountPlan(requests=16, warmup=16, rounds=1, repeats=1)


@dataclass(frozen=True)
class Window:
    """One side's window: the instructions callgrind counted, the event loop's waits (`epoll_wait` calls) and
    the collector's runs (young, middle, full)."""

    side: str
    instructions: int
    waits: int
    collections: tuple[int, int, int]


@dataclass
class Counts:
    """Every process's windows, in the order they ran."""

    requests: int  # per window
    by_process: list[list[Window]] = field(default_factory=list)

    def windows(self, side: str) -> list[Window]:
        return [window for windows in self.by_process for window in windows if window.side == side]

    def mean_waits(self) -> float:
        """The run's waits per call, over every window."""
        return fmean(window.waits / self.requests for windows in self.by_process for window in windows)

    def wait_cost(self) -> float:
        """Instructions per wait of the event loop: the slope of a window's count per call over its waits per
        call, fitted within each side (pooled); 0 where no side's waits differ between its windows."""
        covariance = variance = 0.0
        for side in SIDES:
            mine = self.windows(side)
            if len(mine) < 2:
                continue
            waits = [window.waits / self.requests for window in mine]
            counts = [window.instructions / self.requests for window in mine]
            mean_wait, mean_count = fmean(waits), fmean(counts)
            covariance += sum((w - mean_wait) * (c - mean_count) for w, c in zip(waits, counts, strict=True))
            variance += sum((w - mean_wait) ** 2 for w in waits)
        return covariance / variance if variance else 0.0

    def per_request(self, window: Window, at_equal_waits: bool) -> float:
        """The window's instructions per call, as counted or at the run's mean waits per call."""
        counted = window.instructions / self.requests
        if not at_equal_waits:
            return counted
        return counted - self.wait_cost() * (window.waits / self.requests - self.mean_waits())

    def by_process_per_request(self, side: str, at_equal_waits: bool) -> list[float]:
        """Each process's instructions per call of the side, the mean over its windows."""
        return [
            fmean(self.per_request(window, at_equal_waits) for window in windows if window.side == side)
            for windows in self.by_process
        ]

    def ratios(self, comparison: Comparison, at_equal_waits: bool) -> list[float]:
        """Each process's ours / raw instructions per call."""
        ours = self.by_process_per_request(comparison.ours, at_equal_waits)
        raw = self.by_process_per_request(comparison.raw, at_equal_waits)
        return [mine / theirs for mine, theirs in zip(ours, raw, strict=True)]


# --- the counted client (run under valgrind) ---------------------------------------------------------------------


def _runs(port: int, session: aiohttp.ClientSession) -> dict[str, Run]:
    """Each side's window body: `requests` calls (the raw sides on `session`)."""
    from aiohttp import BytesPayload

    from bench.data_plane import JSON_HEADERS, PATH, PAYLOAD, make_client, ours_post, raw_post
    from gym_rpc.client.server_client import ServerClient, rollout_context

    base = f"http://127.0.0.1:{port}"
    ids = [f"task{index}-rollout{index % 16}" for index in range(64)]

    def calls(post: Callable[[], Awaitable[None]]) -> Run:
        async def run(requests: int) -> None:
            for _ in range(requests):
                await post()

        return run

    def in_rollouts(post: Callable[[], Awaitable[None]]) -> Run:
        async def run(requests: int) -> None:
            for index in range(requests // ROLLOUT_CALLS):
                with rollout_context(ids[index % len(ids)]):
                    for _ in range(ROLLOUT_CALLS):
                        await post()

        return run

    async def raw_lean() -> None:
        body = BytesPayload(orjson.dumps(PAYLOAD), content_type=JSON_HEADERS["Content-Type"])
        async with await session.request("POST", base + PATH, data=body) as response:
            orjson.loads(await response.read())

    async def raw_observed(requests: int) -> None:
        for index in range(requests // ROLLOUT_CALLS):
            url = f"{base}/ng-rollout/{ids[index % len(ids)]}{PATH}"
            for _ in range(ROLLOUT_CALLS):
                async with session.post(url, data=orjson.dumps(PAYLOAD), headers=JSON_HEADERS) as response:
                    orjson.loads(await response.read())

    def client(**global_keys: bool) -> ServerClient:
        made = make_client(port, **global_keys)
        # No follower thread: the bench's head (port 1) never answers, and its retries would land in whichever
        # window they fall in. A worker's follower waits on its watch between the head's changes: no call pays.
        made.follow_instances(False)
        return made

    return {
        "raw": calls(raw_post(session, base + PATH)),
        "raw_lean": calls(raw_lean),
        "ours": calls(ours_post(client())),
        "ours_rollouts": in_rollouts(ours_post(client())),
        "raw_observed": raw_observed,
        "ours_observed": in_rollouts(ours_post(client(observability_enabled=True))),
    }


def _collections() -> list[int]:
    return [generation["collections"] for generation in gc.get_stats()]


async def _count_windows(port: int, warmup: int, requests: int, windows: list[str]) -> list[list[int]]:
    """Warm every side up, freeze the heap, then each window (a side's name) between the two markers, in turn;
    the collector's runs in each window."""
    from bench.data_plane import raw_session
    from gym_rpc.client.data._http import close_http_sessions

    session = raw_session()
    runs = _runs(port, session)
    try:
        for side in dict.fromkeys(windows):
            await runs[side](warmup)
        gc.collect()
        gc.freeze()
        ran: list[list[int]] = []
        for side in windows:
            run = runs[side]
            await run(ROLLOUT_CALLS)  # the side's pooled connection fresh: none is made again inside the window
            before = _collections()
            os.getppid()  # callgrind: zero (ZERO_MARKER)
            await run(requests)
            os.getpgrp()  # callgrind: dump this window's count (DUMP_MARKER)
            ran.append([after - start for start, after in zip(before, _collections(), strict=True)])
        return ran
    finally:
        await close_http_sessions()
        await session.close()


def client_main(port: int, warmup: int, requests: int, windows: list[str]) -> None:
    """`python -m bench.cpu_count client PORT WARMUP REQUESTS SIDE,SIDE,...`: one JSON line, the collector's runs
    in each window (the counts are callgrind's, in its dump files)."""
    print(json.dumps(asyncio.run(_count_windows(port, warmup, requests, windows))), flush=True)


# --- the parent: one valgrind process per repeat -----------------------------------------------------------------


def valgrind() -> str:
    path = shutil.which("valgrind")
    if path is None:
        raise RuntimeError("valgrind is not installed: bench.cpu_count counts instructions with its callgrind")
    return path


def client_environment() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name.lower() not in _ENV_TO_DROP}
    env["PYTHONHASHSEED"] = HASH_SEED
    return env


_NAMED = re.compile(r"c?fn=\((\d+)\)(?: (.*))?")


def read_dump(dump: Path) -> tuple[int, int]:
    """A callgrind dump's `summary:` (the instructions counted since the last zeroing) and the calls made to
    WAIT_FUNCTION (the `calls=` lines under a `cfn=` naming it; names are given once, then by number)."""
    total: int | None = None
    waits = 0
    names: dict[str, str] = {}
    callee = ""
    with dump.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if line.startswith(("fn=", "cfn=")):
                match = _NAMED.match(line.rstrip("\n"))
                if match is not None:
                    if match.group(2):
                        names[match.group(1)] = match.group(2)
                    if line.startswith("cfn="):
                        callee = names.get(match.group(1), "")
            elif line.startswith("calls=") and callee == WAIT_FUNCTION:
                waits += int(line[6:].split()[0])
            elif line.startswith("summary:"):
                total = int(line.split()[1])
    if total is None:
        raise RuntimeError(f"{dump}: no summary line")
    return total, waits


def window_sequence(plan: CountPlan, process: int) -> list[str]:
    """The windows of one process: every side once per round, each round's order rotated by one more side (over
    the processes too), so no side always runs first or after the same side."""
    sequence = []
    for round_index in range(plan.rounds):
        shift = (process * plan.rounds + round_index) % len(SIDES)
        sequence += [*SIDES[shift:], *SIDES[:shift]]
    return sequence


def count_process(port: int, plan: CountPlan, windows: list[str], keep: Path | None = None) -> list[Window]:
    """One client process under callgrind; each window's count from its dump (`callgrind.out.1`, `.2`, ... in the
    order the windows ran), the dumps copied to `keep` (as N-SIDE.callgrind) when given."""
    with tempfile.TemporaryDirectory(prefix="gym_rpc_cpu_count_") as directory:
        out = Path(directory) / "callgrind.out"
        command = [
            valgrind(),
            "--tool=callgrind",
            f"--zero-before={ZERO_MARKER}",
            f"--dump-before={DUMP_MARKER}",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "bench.cpu_count",
            "client",
            str(port),
            str(plan.warmup),
            str(plan.requests),
            ",".join(windows),
        ]
        done = subprocess.run(
            command,
            cwd=REPO_ROOT,
            env=client_environment(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=plan.timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the counted client failed ({done.returncode}): {done.stderr[-3000:]}")
        collections = json.loads(done.stdout.strip().splitlines()[-1])
        dumps = sorted(Path(directory).glob("callgrind.out.*"), key=lambda path: int(path.suffix[1:]))
        if len(dumps) != len(windows):
            raise RuntimeError(
                f"callgrind wrote {len(dumps)} dumps for {len(windows)} windows: is {ZERO_MARKER} in "
                f"{sys.executable}'s symbols (a stripped interpreter has none)?"
            )
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for number, (side, dump) in enumerate(zip(windows, dumps, strict=True), 1):
                shutil.copyfile(dump, keep / f"{number}-{side}.callgrind")
        return [
            Window(side, *read_dump(dump), (ran[0], ran[1], ran[2]))
            for side, dump, ran in zip(windows, dumps, collections, strict=True)
        ]


def count(port: int, plan: CountPlan, keep: Path | None = None) -> Counts:
    """`plan.repeats` client processes, one after the other (their dumps kept in `keep`/N/ when given)."""
    if plan.requests % ROLLOUT_CALLS:
        raise ValueError(f"requests must be a multiple of {ROLLOUT_CALLS}, not {plan.requests}")
    counts = Counts(plan.requests)
    for process in range(plan.repeats):
        started = time.monotonic()
        kept = None if keep is None else keep / str(process + 1)
        windows = count_process(port, plan, window_sequence(plan, process), kept)
        counts.by_process.append(windows)
        figures = ", ".join(
            f"{window.side} {window.instructions / plan.requests:,.0f} ({window.waits / plan.requests:.2f} waits)"
            for window in windows
        )
        took = time.monotonic() - started
        print(
            f"  cpu count: process {process + 1} of {plan.repeats} ({took:.0f} s): {figures}",
            file=sys.stderr,
            flush=True,
        )
    return counts


# --- the rows ----------------------------------------------------------------------------------------------------


def spread_percent(values: list[float]) -> float:
    """(highest - lowest) / median, in per cent."""
    return (max(values) - min(values)) / median(values) * 100


def _figure(counts: Counts, side: str) -> str:
    windows = counts.windows(side)
    young, middle, full = (fmean(window.collections[g] for window in windows) for g in range(3))
    counted = [counts.per_request(window, at_equal_waits=False) for window in windows]
    equal = [counts.per_request(window, at_equal_waits=True) for window in windows]
    waits = fmean(window.waits for window in windows) / counts.requests
    return (
        f"{median(counts.by_process_per_request(side, True)):,.0f} instructions/req at equal waits "
        f"({median(counts.by_process_per_request(side, False)):,.0f} counted); its {len(windows)} windows within "
        f"{spread_percent(equal):.2f} % ({spread_percent(counted):.2f} % counted), {waits:.2f} loop waits/req, "
        f"GC runs per window {young:.0f}/{middle:.0f}/{full:.0f}"
    )


def rows(counts: Counts, plan: CountPlan) -> list[Row]:
    result = []
    for comparison in COMPARISONS:
        ratios = counts.ratios(comparison, at_equal_waits=True)
        counted = counts.ratios(comparison, at_equal_waits=False)
        ratio = median(ratios)
        measure = (
            f"client instructions per request (callgrind), {comparison.measure}: {plan.repeats} processes of "
            f"{plan.rounds} rounds, a window of {counts.requests} sequential POST /v1/responses per side a "
            f"round, PYTHONHASHSEED={HASH_SEED} (ratio ours / raw at the run's mean "
            f"{counts.mean_waits():.2f} loop waits per call, each {counts.wait_cost():,.0f} instructions: median "
            f"of the processes' {min(ratios):.4f}-{max(ratios):.4f}; as counted {median(counted):.4f}, "
            f"{min(counted):.4f}-{max(counted):.4f})"
        )
        goal = comparison.goal
        result.append(
            Row(
                AREA,
                measure,
                _figure(counts, comparison.ours),
                f"{comparison.baseline}: {_figure(counts, comparison.raw)}",
                ratio,
                "" if goal is None else f"≤ {goal:.2f}x",
                None if goal is None else not math.isnan(ratio) and ratio <= goal,
                goal,  # shown with three digits where two would read as the goal itself
            )
        )
    return result


def run(plan: CountPlan, keep: Path | None = None) -> list[Row]:
    """The rows, against a data server of their own (natively, not under valgrind)."""
    from bench.servers import ServerProcess

    with ServerProcess("data") as data:
        return rows(count(int(data.info["port"]), plan, keep), plan)


def section(found: list[Row], plan: CountPlan, elapsed: float) -> str:
    """bench/CPU_COUNT.md: what bench/report.py puts into bench/RESULTS.md."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = " / ".join(f"{value:.1f}" for value in os.getloadavg())
    return "\n".join(
        [
            f"Written by `{plan.command()}` on {when} in {elapsed / 60:.1f} min (load average {load}: the counts "
            "do not depend on it). What is counted, and how: bench/cpu_count.py's docstring.",
            "",
            *table_lines(found),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["client"]:  # the counted process, started by count_process under valgrind
        port, warmup, requests, windows = argv[1:]
        client_main(int(port), int(warmup), int(requests), windows.split(","))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_count", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help=f"per window (default {CountPlan.requests})")
    parser.add_argument("--rounds", type=int, help=f"windows per side in a process (default {CountPlan.rounds})")
    parser.add_argument("--repeats", type=int, help=f"client processes (default {CountPlan.repeats})")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one process: a smoke run")
    parser.add_argument(
        "--keep", type=Path, help="keep each window's callgrind dump in DIR/PROCESS/N-SIDE.callgrind"
    )
    parser.add_argument("--out", type=Path, help="also write the section there (bench/CPU_COUNT.md: RESULTS.md's)")
    args = parser.parse_args(argv)
    base = QUICK_COUNT if args.quick else CountPlan()
    plan = CountPlan(
        requests=args.requests or base.requests,
        warmup=args.requests or base.warmup,
        rounds=args.rounds or base.rounds,
        repeats=args.repeats or base.repeats,
    )
    started = time.monotonic()
    found = run(plan, args.keep)
    print("\n".join(table_lines(found)))
    if args.out is not None:
        args.out.write_text(section(found, plan, time.monotonic() - started), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
