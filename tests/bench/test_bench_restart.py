"""`python -m bench.restart --quick` runs and reports (a smoke run: its figures mean nothing; see
test_bench_smoke.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench import finished, quick_runs


@pytest.mark.timeout(180 + 30)  # `finished`'s hang guard
def test_the_restart_bench_runs_its_three_runs_and_reports_them(tmp_path: Path) -> None:
    """`python -m bench.restart --quick`: a head killed -9 and restarted with and without its file, and the
    followed of two heads killed, each with rollouts in flight: each run has its row (its figures mean nothing)."""
    with quick_runs(tmp_path, "bench.restart") as runs:
        stdout, report = finished(tmp_path, "bench.restart", runs["bench.restart"])
    for run in (
        "restart, registrations file kept",
        "restart, registrations file deleted",
        "failover: the followed of two heads killed",
    ):
        assert f"| {run} | " in report and f"| {run} | " in stdout, run
