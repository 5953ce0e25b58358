"""Smoke runs of the benchmarks: `python -m MODULE --quick ...` in a subprocess, its output in files. Each run is a
process group of its own, killed whole if still running at the end: a bench killed alone (its hang guard) left the
heads and servers it had started running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.support import REPO_ROOT


@contextlib.contextmanager
def quick_runs(tmp_path: Path, *modules: str) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """`python -m MODULE --quick --out tmp/MODULE.md` for each module at once, stdout and stderr into files (no
    pipe to fill while the other is awaited); every one still running at exit is killed."""
    runs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for module in modules:
            with (tmp_path / f"{module}.out").open("wb") as out, (tmp_path / f"{module}.err").open("wb") as err:
                command = [sys.executable, "-m", module, "--quick", "--out", str(tmp_path / f"{module}.md")]
                runs[module] = subprocess.Popen(
                    command, cwd=REPO_ROOT, stdout=out, stderr=err, start_new_session=True
                )
        yield runs
    finally:
        for run in runs.values():
            _kill_group(run)


def finished(tmp_path: Path, module: str, run: subprocess.Popen[bytes]) -> tuple[str, str]:
    """The run's stdout and report, once it exited 0 (180 s: a hang guard, several times a loaded machine's)."""
    code = run.wait(timeout=180)
    assert code == 0, (tmp_path / f"{module}.err").read_text(encoding="utf-8")[-3000:]
    stdout = (tmp_path / f"{module}.out").read_text(encoding="utf-8")
    return stdout, (tmp_path / f"{module}.md").read_text(encoding="utf-8")


@contextlib.contextmanager
def quick_runs_of(tmp_path: Path, module_and_args: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m MODULE ARGS...`, stdout and stderr into files; killed at exit if still running."""
    with (tmp_path / "run.out").open("wb") as out, (tmp_path / "run.err").open("wb") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", *module_and_args], cwd=REPO_ROOT, stdout=out, stderr=err, start_new_session=True
        )
    try:
        yield run
    finally:
        _kill_group(run)


def _kill_group(run: subprocess.Popen[bytes]) -> None:
    """The run's whole process group, if the run is still going (its children die with it), then the run reaped."""
    if run.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=10)
