"""bench/cpu_count.py counts client instructions per request under callgrind. `python -m bench.cpu_count --quick`
runs every side once under valgrind and reports its rows (a smoke run: its figures mean nothing; see
test_bench_smoke.py); the reading of callgrind's dumps and the correction for the event loop's waits are checked
in-process on dumps and windows made here."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from bench.cpu_count import COMPARISONS, SIDES, Counts, Window, read_dump
from tests.support.bench import finished, quick_runs


# A benchmark smoke run: a minute and more of one core under valgrind. It counts instructions, so it needs no
# machine of its own (the `load` tier is for what floods the machine or measures times).
@pytest.mark.build
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.timeout(180 + 30)  # `finished`'s hang guard
def test_the_count_runs_every_side_under_callgrind_and_reports_its_rows(tmp_path: Path) -> None:
    """Each row names both sides' instructions per request, the loop's waits per call (read from the dumps: a
    parser that found none would quietly drop the correction) and the collector's runs."""
    with quick_runs(tmp_path, "bench.cpu_count") as runs:
        stdout, report = finished(tmp_path, "bench.cpu_count", runs["bench.cpu_count"])
    rows = [line for line in stdout.splitlines() if "client instructions per request (callgrind)" in line]
    assert len(rows) == len(COMPARISONS), stdout
    for row in rows:
        assert row in report
        counts = [float(count.replace(",", "")) for count in re.findall(r"([\d,]+) instructions/req at", row)]
        assert len(counts) == 2 and all(100_000 < count < 10_000_000 for count in counts), row
        waits = [float(wait) for wait in re.findall(r"([\d.]+) loop waits/req", row)]
        assert len(waits) == 2 and all(wait >= 1 for wait in waits), row
        assert row.count("GC runs per window") == 2, row
        ratio = row.split(" | ")[4]
        assert ratio.endswith("x") and 0.5 < float(ratio[:-1]) < 2, row


def test_a_dump_gives_its_summary_and_the_calls_to_the_loops_wait(tmp_path: Path) -> None:
    """Names are given once, then by number: calls to epoll_wait are counted under either form, from any caller;
    calls to other functions are not."""
    dump = tmp_path / "callgrind.out.1"
    dump.write_text(
        "events: Ir\nsummary: 123456\n\n"
        "fn=(1) select_epoll_poll_impl\n0 10\ncfn=(2) epoll_wait\ncalls=3 0\n0 90\ncfn=(3) epoll_ctl\ncalls=5 0\n"
        "0 40\n\nfn=(4) other\n0 5\ncfn=(2)\ncalls=2 0\n0 60\n",
        encoding="utf-8",
    )
    assert read_dump(dump) == (123456, 5)


def test_the_waits_correction_takes_out_what_the_servers_timing_adds_and_keeps_the_sides_difference() -> None:
    """Windows whose counts differ only by their waits (each wait 13,000 instructions) read the same at equal
    waits; the difference between two sides stays whole."""
    requests = 100
    per_wait = 13_000
    base = {side: 450_000 + 1_000 * index for index, side in enumerate(SIDES)}

    def window(side: str, waits_per_call: float) -> Window:
        per_call = base[side] + per_wait * waits_per_call
        return Window(side, round(per_call * requests), round(waits_per_call * requests), (0, 0, 0))

    counts = Counts(requests)
    for shift in (0.0, 0.3, 0.6):
        counts.by_process.append([window(side, 3.0 + shift + 0.1 * index) for index, side in enumerate(SIDES)])
    assert counts.wait_cost() == pytest.approx(per_wait)
    comparison = COMPARISONS[0]
    difference = base[comparison.ours] - base[comparison.raw]
    ours = counts.by_process_per_request(comparison.ours, at_equal_waits=True)
    raw = counts.by_process_per_request(comparison.raw, at_equal_waits=True)
    assert [mine - theirs for mine, theirs in zip(ours, raw, strict=True)] == pytest.approx([difference] * 3)
    assert max(ours) - min(ours) == pytest.approx(0, abs=1e-6)  # the same in every process, whatever its waits
    counted = counts.by_process_per_request(comparison.ours, at_equal_waits=False)
    assert max(counted) - min(counted) == pytest.approx(0.6 * per_wait)
