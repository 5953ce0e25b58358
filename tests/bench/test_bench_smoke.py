"""`python -m bench --quick` runs every benchmark at tiny sizes (real server processes on loopback) and prints the
ratio table, and `python -m bench.scale --quick` does the same for the scale report, so the bench code cannot rot
between `make bench` runs. The figures of a quick run mean nothing; only that each benchmark ran and reported is
checked. Both run at once: each spends much of its time starting and awaiting its own processes. They flood the
machine (2,048 connections at once), so `make test` runs them alone (`load`); the smaller restart and relay runs
have modules of their own (test_bench_restart.py, test_bench_relay.py), run by the parallel workers (`build`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench import finished, quick_runs


@pytest.mark.timeout(2 * 180 + 30)  # the runs' own hang guards (`finished`), not the suite's 60 s per test
def test_quick_benches_print_their_tables_and_write_their_reports(tmp_path: Path) -> None:
    with quick_runs(tmp_path, "bench", "bench.scale") as runs:
        stdout, report = finished(tmp_path, "bench", runs["bench"])
        check_ratio_table(stdout, report)
        check_scale_report(finished(tmp_path, "bench.scale", runs["bench.scale"])[1])


def check_ratio_table(stdout: str, report: str) -> None:
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| area | measure | gym_rpc | baseline (same run) | ratio | goal | met |"
    rows = [line.split(" | ") for line in table[1:]]
    areas = {cells[0].lstrip("| ") for cells in rows}
    assert areas == {
        "data plane",
        "hot path",
        "tracing",
        "metrics",
        "control plane",
        "isolation",
        "memory",
        "replicas",
    }
    for cells in rows:
        ratio = cells[4]
        if cells[3] == "—" or (ratio == "n/a" and cells[5] in ("0 failed", "only the dead one's")):
            continue  # a figure against its goal alone (no baseline to divide by), or a count set beside one
        assert ratio.endswith("x") and float(ratio[:-1]) > 0, cells
    measures = " ".join(cells[1] for cells in rows)
    for expected in (
        "concurrency 1, GC on beside a live heap",
        "concurrency 64, GC on beside a live heap",
        "concurrency 512, GC on beside a live heap",
        "concurrency 2048, GC on beside a live heap",
        "objects a call keeps alive while it waits",
        "RSS after `import gym_rpc.client.server_client`",
        "config fetch",
        "ListServerStatuses",
        "with vs without its speed trick (its data-plane state cached in one plain attribute), concurrency 1",
        "ServerClient.post's own work (no I/O)",
        "traced / untraced, every call recorded, concurrency 64",
        "1 rollout in 10 sampled",
        "raw aiohttp instrumented / not (opentelemetry-instrumentation-aiohttp-client), every call recorded, "
        "concurrency 64",
        "raw aiohttp instrumented / not (opentelemetry-instrumentation-aiohttp-client), 1 rollout in 10 sampled "
        "(rollouts of 8 calls), concurrency 64",
        "(rollouts of 8 calls), over raw aiohttp instrumented / not",
        "with worker metrics / without",
        "picking among 64 instances",
        "p99 latency against round robin",
        "failed calls (kill -9 of one of 4 replicas",
        "a fifth replica registers with the head",
    ):
        assert expected in measures
    assert "goals met" in stdout
    assert "## Machine" in report and "nproc:" in report and "grpcio" in report and "aiohttp" in report
    assert table[0] in report


def check_scale_report(report: str) -> None:
    """Every section is written with its rows, and the probes through the head stay within one per freshness
    window."""
    for heading in (
        "## Servers N",
        "## Config at N = 6",
        "## Watchers W",
        "## Pollers P",
        "## Goals",
        "## Watchers at fleet size",
        "## A storm of 1,000 changes within a second, at fleet size",
    ):
        assert heading in report, heading
    assert "| 8 | gym_rpc head | " in report and "| 8 | bare grpc.aio | " in report  # the fleet rows
    assert "| 8 | gym_rpc head | 1 | " in report and "| 8 | bare grpc.aio | 1 | " in report  # a storm each
    assert "| last watcher current within 1 s of the storm's end at W = 8 | " in report
    assert "| 8 | gym_rpc head, 2 relays | 1 | " in report  # the same storm through watch relays
    assert "| last watcher current within 1 s of the storm's end at W = 8, through 2 relays | " in report
    for row in ("| 3 | ", "| 6 | ", "| whole document | ", "| `known_version` = current"):
        assert row in report, row
    assert "| probes received per window <= 1, whatever P | " in report
    assert "refused during these runs (UNAVAILABLE, streams past a connection's limit): 0." in report


def test_a_ratio_at_its_goal_to_two_digits_is_shown_with_three() -> None:
    """A miss never reads as the goal itself: 0.848 against 0.85 shows "0.848x" (and its verdict NO), 0.853 shows
    "0.853x", while ratios that two digits tell apart from the goal, and rows without one, keep two."""
    from bench.stats import ratio_row, table_lines

    def shown(ratio: float, goal: float | None) -> list[str]:
        [_, _, line] = table_lines([ratio_row("tracing", "m", "a", "b", ratio, goal)])
        return line.rstrip(" |").split(" | ")[4:7]

    assert shown(0.848, 0.85) == ["0.848x", "≥ 0.85x", "NO"]
    assert shown(0.853, 0.85) == ["0.853x", "≥ 0.85x", "yes"]
    assert shown(0.85, 0.85) == ["0.85x", "≥ 0.85x", "yes"]
    assert shown(0.87, 0.85) == ["0.87x", "≥ 0.85x", "yes"]
    assert shown(0.848, None) == ["0.85x", "—", "—"]


def test_rounds_made_on_several_process_pairs_show_each_pairs_median() -> None:
    """The spread names the lowest and highest of the pairs' medians, so a pair of processes faster than the others
    shows; with one pair there is nothing to name."""
    from bench.stats import spread_text

    by_pair = [[0.90, 0.92, 0.94], [1.00, 1.02, 1.04]]
    ratios = [ratio for pair in by_pair for ratio in pair]
    assert spread_text(ratios, by_pair).endswith(", 2 process pairs' medians 0.92-1.02")
    assert "process pairs" not in spread_text(ratios, by_pair[:1])
    assert "process pairs" not in spread_text(ratios)


def test_every_pair_of_processes_makes_rounds_even_when_asked_for_fewer_than_pairs() -> None:
    from bench.side_worker import rounds_per_pair

    assert [rounds_per_pair(rounds, 4) for rounds in (80, 60, 40, 2, 1)] == [20, 15, 10, 1, 1]


def test_a_row_stops_taking_process_pairs_once_its_median_is_known_and_its_pairs_agree() -> None:
    """bench.stats.settled: never on one pair, however tight; yes on two tight pairs that agree; no when the pairs'
    medians differ by more than PAIRS_AGREE, or when the rounds scatter too widely to pin the median."""
    from bench.stats import PAIRS_AGREE, settled

    tight = [[0.99, 1.00, 1.01] * 4, [0.99, 1.00, 1.01] * 4]
    assert settled([r for pair in tight for r in pair], tight)
    assert not settled(tight[0], tight[:1])
    apart = [[0.98] * 12, [0.98 + PAIRS_AGREE + 0.01] * 12]
    assert not settled([r for pair in apart for r in pair], apart)
    scattered = [[0.7, 1.0, 1.3] * 4, [0.7, 1.0, 1.3] * 4]
    assert not settled([r for pair in scattered for r in pair], scattered)
    few = [[1.0] * 4, [1.0] * 4]
    assert not settled([1.0] * 8, few)


def test_a_spent_budget_stops_the_rounds_but_never_before_its_share_of_ten() -> None:
    """bench.stats.Budget: a pair's rounds stop once its seconds are spent, after at least its share of 10 rounds
    (3 of 4 pairs' 40); with no budget every round the plan gives is made."""
    import asyncio

    from bench.data_plane import Block, abba_rounds
    from bench.stats import MIN_ROUNDS, pair_budget

    async def block() -> Block:
        return Block(100.0, 100.0)

    spent = pair_budget(0.0, 4)
    assert spent.at_least == 3 and 4 * spent.at_least >= MIN_ROUNDS
    assert len(asyncio.run(abba_rounds(block, block, 20, spent))[0]) == 3
    assert len(asyncio.run(abba_rounds(block, block, 20))[0]) == 20
    assert len(asyncio.run(abba_rounds(block, block, 20, pair_budget(3600.0, 4)))[0]) == 20


def test_a_failed_section_leaves_a_row_naming_its_error_and_the_other_sections_still_run() -> None:
    """bench.__main__.Collected: a section that raises is a row (goal "runs", not met) and the run goes on; once
    stopped (SIGTERM), the sections after it are left out and the rows made so far kept."""
    from bench.__main__ import Collected, Stopped
    from bench.stats import Row

    def fails() -> list[Row]:
        raise RuntimeError("536 failed: ConnectionTimeoutError")

    def stops() -> list[Row]:
        raise Stopped("stopped by signal 15")

    made = Row("memory", "import", "31 MB", "101 MB", 3.3)
    collected = Collected()
    collected.take("data plane", lambda: [made])
    collected.take("memory", fails)
    collected.take("replicas", lambda: [made])
    assert collected.rows[0] is made and collected.rows[2] is made
    assert (collected.rows[1].area, collected.rows[1].met) == ("memory", False)
    assert "RuntimeError: 536 failed" in collected.rows[1].measure and collected.failed
    collected.take("tracing", stops)
    collected.take("metrics", lambda: [made])
    assert collected.stopped and len(collected.rows) == 4 and "signal 15" in collected.rows[3].measure
    assert not Collected(rows=[made]).failed


def test_a_data_plane_row_gives_the_per_round_cpu_ratio_beside_the_medians() -> None:
    """Our CPU per request over raw aiohttp's, round by round (each side's two blocks of a round): the 2 % bound of
    issue 41 is judged by its median and scatter, which the medians of each side alone do not show."""
    from bench.data_plane import Block, Comparison, cpu_ratios, rows_of

    ours = [Block(100.0, 102.0), Block(100.0, 102.0), Block(100.0, 90.0), Block(100.0, 110.0)]
    raw = [Block(100.0, 100.0), Block(100.0, 100.0), Block(100.0, 100.0), Block(100.0, 100.0)]
    assert [round(r, 6) for r in cpu_ratios(ours, raw)] == [1.02, 1.0]
    row = rows_of(Comparison(64, [1.0, 1.0], ours, raw, [[1.0, 1.0]]), "a heap")[0]
    assert "CPU/req ours ÷ raw per round: median 1.010, middle half 1.00-1.02" in row.measure


class _FixedSide:
    """A side whose every block runs at `rps` requests per second (bench.side_worker.SideWorker's `block`)."""

    def __init__(self, rps: float) -> None:
        self.rps = rps

    def block(self, concurrency: int, requests: int) -> tuple[float, float, tuple[float, ...]]:
        return self.rps, 100.0, (0.0, 0.0, 0.0)


def test_tracing_against_its_peer_divides_our_ratio_by_the_peers_round_by_round() -> None:
    """Ours on/off 0.8 and the peer's 0.5: the quotient row reads 1.6 against its goal of 1 (met), and each
    comparison keeps its own sides' blocks (a swap of ours and the peer's, or of on and off, fails this)."""
    import asyncio

    from bench.flag_cost import Rounds, against_peer_rounds, quotient_row
    from bench.tracing_sampled_cost import COST

    ours, theirs, quotients = Rounds(64), Rounds(64), Rounds(64)
    sides = (_FixedSide(80.0), _FixedSide(100.0), _FixedSide(50.0), _FixedSide(100.0))
    asyncio.run(against_peer_rounds(sides, ours, theirs, quotients, 512, 3))  # type: ignore[arg-type]
    assert [round(r, 6) for r in ours.ratios] == [0.8] * 3
    assert [round(r, 6) for r in theirs.ratios] == [0.5] * 3
    assert [round(r, 6) for r in quotients.ratios] == [1.6] * 3
    assert {b.requests_per_second for b in ours.on} == {80.0}
    assert {b.requests_per_second for b in theirs.on} == {50.0}
    assert [len(pair) for pair in quotients.by_pair] == [3]
    assert COST.peer is not None
    row = quotient_row(COST, COST.peer, ours, theirs, quotients)
    assert (round(row.ratio, 6), row.goal_ratio, row.met) == (1.6, 1.0, True)
    assert (row.ours, row.baseline) == ("gym_rpc traced/off: 0.80", "peer instrumented/off: 0.50")


def test_the_hot_path_comparison_runs_the_shipped_call_and_reads_state_through_the_client() -> None:
    """bench.hot_path's client without the trick runs the shipped DataPlane.call itself (a copy of it once skipped
    the routing lookup and the switch checks the shipped one makes), on a data plane whose state is read from the
    client's private attributes at each use."""
    import asyncio

    from bench.data_plane import PATH, PAYLOAD, SERVER_NAME
    from bench.hot_path import STATE, PrivateReads, WithoutTrick, _no_io, make_without
    from gym_rpc.client.data import DataPlane
    from gym_rpc.client.server_client import ServerClient

    assert "request" not in vars(WithoutTrick) and "call" not in vars(PrivateReads)
    assert {"base_urls", "config", "pools", "routing"} == STATE
    client = _no_io(make_without(1))

    async def one_call() -> None:
        await client.request(SERVER_NAME, PATH, "POST", json=PAYLOAD)

    asyncio.run(one_call())
    plane = client._data_plane
    assert isinstance(plane, PrivateReads) and isinstance(plane, DataPlane) and isinstance(client, ServerClient)
    assert plane.routing is client._endpoints.routing and plane.routing is not None
    assert plane.pools is client._http and plane.base_urls is client._server_base_urls
    assert plane.config is client._global_config


def test_results_take_the_fleet_sections_of_the_scale_report(tmp_path: Path) -> None:
    """`make bench` rewrites bench/RESULTS.md; its fleet section is what bench/SCALE.md's fleet runs last wrote
    (each between its markers), headings a level down, and none when SCALE.md has neither."""
    from bench.report import FLEET_TITLE, fleet_lines
    from bench.scale import FLEET_END, FLEET_START, FLEET_STORMS_END, FLEET_STORMS_START

    scale = tmp_path / "SCALE.md"
    scale.write_text("# Scale\n\n## Servers N\n\nnot fleet\n", encoding="utf-8")
    assert fleet_lines(scale) == []
    scale.write_text(
        f"# Scale\n\n## Servers N\n\nnot fleet\n\n{FLEET_START}\n## Watchers at fleet size\n\n| 1000 | a |\n"
        f"{FLEET_END}\n\n{FLEET_STORMS_START}\n## A storm\n\n| 1000 | b |\n{FLEET_STORMS_END}\nafter\n",
        encoding="utf-8",
    )
    assert fleet_lines(scale) == [
        FLEET_TITLE,
        "",
        "What each run was, what changed between runs and later runs of one W: the notes after each section in "
        "bench/SCALE.md.",
        "",
        "### A storm",
        "",
        "| 1000 | b |",
        "",
        "### Watchers at fleet size",
        "",
        "| 1000 | a |",
    ]
