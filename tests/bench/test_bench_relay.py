"""`python -m bench --quick --only relay` runs and prints its rows (a smoke run: its figures mean nothing; see
test_bench_smoke.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench import quick_runs_of


@pytest.mark.timeout(180 + 30)
def test_the_relay_bench_prints_its_rows(tmp_path: Path) -> None:
    """`python -m bench --only relay` (left out of `--quick`'s whole run, which is long enough): its four rows."""
    with quick_runs_of(tmp_path, ["bench", "--quick", "--only", "relay"]) as run:
        code = run.wait(timeout=180)
    assert code == 0, (tmp_path / "run.err").read_text(encoding="utf-8")[-3000:]
    stdout = (tmp_path / "run.out").read_text(encoding="utf-8")
    rows = [line for line in stdout.splitlines() if "per-address relay:" in line]
    assert len(rows) == 4, stdout
    for measure in ("GetServerStatus calls/s", "head CPU per GetServerStatus call", "watch fan-out"):
        assert any(measure in row for row in rows), measure
