"""`python -m bench --quick` runs every benchmark at tiny sizes (real server processes on loopback) and prints the
ratio table, so the bench code cannot rot between `make bench` runs. The figures of a quick run mean nothing; only
that each benchmark ran and reported is checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_quick_bench_prints_the_ratio_table_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,  # a hang guard: about 30 s on a quiet machine, several times that under load
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| area | measure | gym_rpc | baseline (same run) | ratio | goal | met |"
    rows = [line.split(" | ") for line in table[1:]]
    areas = {cells[0].lstrip("| ") for cells in rows}
    assert areas == {"data plane", "hot path", "tracing", "metrics", "control plane", "isolation", "memory"}
    for cells in rows:
        ratio = cells[4]
        assert ratio.endswith("x") and float(ratio[:-1]) > 0, cells
    measures = " ".join(cells[1] for cells in rows)
    for expected in (
        "concurrency 1 ",
        "concurrency 64 ",
        "concurrency 512 ",
        "config fetch",
        "ListServerStatuses",
        "with vs without its speed trick (one read of pydantic's private store), concurrency 1",
        "ServerClient.post's own work (no I/O)",
        "traced / untraced, concurrency 64",
        "1 rollout in 10 sampled",
        "with worker metrics / without",
    ):
        assert expected in measures
    assert "goals met" in done.stdout
    report = out.read_text(encoding="utf-8")
    assert "## Machine" in report and "nproc:" in report and "grpcio" in report and "aiohttp" in report
    assert table[0] in report


def test_quick_scale_bench_writes_every_section_and_the_goals(tmp_path: Path) -> None:
    """`python -m bench.scale --quick`: real head and server processes at tiny sizes; every section is written
    with its rows, and the probes through the head stay within one per freshness window."""
    out = tmp_path / "SCALE.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text(encoding="utf-8")
    for heading in ("## Servers N", "## Config at N = 6", "## Watchers W", "## Pollers P", "## Goals"):
        assert heading in report, heading
    for row in ("| 3 | ", "| 6 | ", "| whole document | ", "| `known_version` = current"):
        assert row in report, row
    assert "| probes received per window <= 1, whatever P | " in report
    assert "refused during these runs (UNAVAILABLE, streams past a connection's limit): 0." in report
