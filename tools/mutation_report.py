"""Write bench/MUTATION.md from the results `mutmut run` left in mutants/ (`make mutate` runs both).

Per module: mutants, killed by a test, rejected by mypy, survived, not covered by the selected tests, timeouts.
Every survivor is listed with its diff and the line of tools/mutation_notes.toml that explains it (why it is
equivalent); a survivor without a note is marked UNEXPLAINED, so a new survivor cannot hide in the totals. Timeouts
are listed with their diffs too (a mutant that hangs a test counts as killed; a reader can check that it hangs).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
NOTES = ROOT / "tools" / "mutation_notes.toml"
DEBUG_LOG = MUTANTS / "mutmut-debug.log"  # `log_to_file`: one "Completed NAME: exit=N (Ss)" line per mutant run
KILLS = MUTANTS / "mutmut-kills.jsonl"  # tests/support/mutation_selection.py: the tests that failed, per mutant

# mutmut's exit codes (mutmut.stats.status_by_exit_code), kept here so this script needs no mutmut import.
STATUS_BY_EXIT_CODE: dict[int | None, str] = {
    1: "killed",
    3: "killed",
    37: "mypy",
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    36: "timeout",
    24: "timeout",
    -24: "timeout",
    152: "timeout",
    255: "timeout",
    None: "not checked",
}
COLUMNS = ("killed", "mypy", "survived", "no tests", "timeout", "not checked", "other")
COMPLETED = re.compile(r"Completed (\S+): exit=(-?\d+) \(([\d.]+)s\)")


def status_of(exit_code: int | None) -> str:
    return STATUS_BY_EXIT_CODE.get(exit_code, "other")


def load_results() -> dict[str, dict[str, str]]:
    """module path -> mutant name -> status."""
    results: dict[str, dict[str, str]] = {}
    for meta in sorted(MUTANTS.rglob("*.py.meta")):
        module = str(meta.relative_to(MUTANTS))[: -len(".meta")]
        exit_codes = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
        results[module] = {name: status_of(code) for name, code in exit_codes.items()}
    return results


def run_seconds() -> dict[str, float]:
    """mutant -> wall-clock seconds of its last run (from mutmut's debug log)."""
    if not DEBUG_LOG.exists():
        return {}
    return {m[1]: float(m[3]) for m in COMPLETED.finditer(DEBUG_LOG.read_text(encoding="utf-8", errors="replace"))}


def killers() -> dict[str, str]:
    """mutant -> the first test that failed against it."""
    first: dict[str, str] = {}
    if KILLS.exists():
        for line in KILLS.read_text(encoding="utf-8").splitlines():
            kill = json.loads(line)
            first.setdefault(kill["mutant"], kill["test"])
    return first


def mutant_diff(name: str) -> str:
    shown = subprocess.run(
        [sys.executable, "-m", "mutmut", "show", name], cwd=ROOT, capture_output=True, text=True, check=False
    )
    lines = [
        line
        for line in shown.stdout.splitlines()
        if line.startswith(("-", "+")) and line[:3] not in ("---", "+++")
    ]
    return "\n".join(lines) or shown.stdout.strip()


def timing_lines(results: dict[str, dict[str, str]], seconds: dict[str, float]) -> list[str]:
    """Per-mutant wall-clock time by verdict: where the run's time went."""
    by_status: dict[str, list[float]] = {}
    for statuses in results.values():
        for name, status in statuses.items():
            if name in seconds:
                by_status.setdefault(status, []).append(seconds[name])
    if not by_status:
        return []
    out = ["| verdict | mutants run | median s | mean s | worker-minutes |", "| --- | --- | --- | --- | --- |"]
    for status, times in sorted(by_status.items()):
        out.append(
            f"| {status} | {len(times)} | {statistics.median(times):.1f} | {statistics.fmean(times):.1f} "
            f"| {sum(times) / 60:.1f} |"
        )
    return [*out, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, help="how long `mutmut run` took (make mutate measures it)")
    parser.add_argument("--load-start", help="the load average when it started (/proc/loadavg)")
    parser.add_argument("--load", help="the load average when it ended (/proc/loadavg)")
    parser.add_argument("--commit", help="the commit the mutants were made from")
    parser.add_argument("--workers", type=int, default=4, help="mutmut's --max-children")
    args = parser.parse_args()
    results = load_results()
    notes: dict[str, str] = tomllib.loads(NOTES.read_text(encoding="utf-8")) if NOTES.exists() else {}
    seconds = run_seconds()
    first_failure = killers()
    totals: Counter[str] = Counter()
    rows = []
    for module, statuses in results.items():
        counts = Counter(statuses.values())
        totals.update(counts)
        rows.append(f"| `{module}` | {len(statuses)} | " + " | ".join(str(counts[c]) for c in COLUMNS) + " |")
    run = []
    if args.seconds is not None:
        run.append(
            f"Run: {args.seconds / 60:.1f} min from scratch (mutants/ removed first), {args.workers} workers"
            + (f", commit {args.commit}" if args.commit else "")
            + f"; load average at the start {args.load_start or '?'}, at the end {args.load or '?'}."
        )
    out = [
        "# Mutation testing",
        "",
        "`make mutate` (mutmut, configured in `[tool.mutmut]` of pyproject.toml) mutates the security,",
        "redaction and config-validation, rollout-prefix, watch and data-plane retry modules. mypy (strict,",
        "as in `make lint`) checks every mutant first: one it rejects could never pass `make test` and is",
        "not run (column mypy). Each other mutant runs the selection's tests (tests/support/mutation_selection)",
        "that executed the mutated function, fastest first, stopping at the first failure. Killed: a test",
        "failed. Survived: every test passed (each one is explained below). No tests: no test of the selection",
        "runs that function (listed below). Timeout: a test hung past 4 x (the tests' recorded time + 5 s).",
        "",
        *run,
        "",
        "| module | mutants | " + " | ".join(COLUMNS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
        *rows,
        f"| **all** | {sum(totals.values())} | " + " | ".join(str(totals[c]) for c in COLUMNS) + " |",
        "",
        *timing_lines(results, seconds),
    ]
    kills_by_file = Counter(test.split("::")[0] for test in first_failure.values())
    if kills_by_file:
        out += ["Mutants killed, by the file of the first test that failed:", ""]
        out += [f"* `{file}`: {count}" for file, count in kills_by_file.most_common()]
        out.append("")
    out += ["## Survivors", ""]
    unexplained = 0
    for statuses in results.values():
        for name, status in statuses.items():
            if status != "survived":
                continue
            note = notes.get(name)
            if note is None:
                unexplained += 1
            out += [f"### `{name}`", "", "```diff", mutant_diff(name), "```", "", note or "UNEXPLAINED", ""]
    out += ["## Timeouts", ""]
    for statuses in results.values():
        for name, status in statuses.items():
            if status == "timeout":
                out += [f"### `{name}`", "", "```diff", mutant_diff(name), "```", ""]
                if name in notes:
                    out += [notes[name], ""]
    out += ["## Not covered by the selected tests", ""]
    for module, statuses in results.items():
        uncovered = sorted({name.split("__mutmut_")[0] for name, s in statuses.items() if s == "no tests"})
        if uncovered:
            out.append(f"* `{module}`: " + ", ".join(f"`{n.rsplit('.', 1)[-1]}`" for n in uncovered))
    out += ["", f"Unexplained survivors: {unexplained}.", ""]
    print("\n".join(out))


if __name__ == "__main__":
    main()
