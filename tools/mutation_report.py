"""Write bench/MUTATION.md from the results `mutmut run` left in mutants/ (`make mutate` runs both).

Per module: mutants, killed, survived, not covered by the selected tests, timeouts. Every survivor is listed with
its diff and the line of tools/mutation_notes.toml that explains it (equivalent, or the test that now kills it);
a survivor without a note is marked UNEXPLAINED, so a new survivor cannot hide in the totals.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
NOTES = ROOT / "tools" / "mutation_notes.toml"

# mutmut's exit codes (mutmut.stats.status_by_exit_code), kept here so this script needs no mutmut import.
STATUS_BY_EXIT_CODE: dict[int | None, str] = {
    1: "killed",
    3: "killed",
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
COLUMNS = ("killed", "survived", "no tests", "timeout", "not checked", "other")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, help="how long `mutmut run` took (make mutate measures it)")
    parser.add_argument("--load", help="the load average when it ended (/proc/loadavg)")
    args = parser.parse_args()
    results = load_results()
    notes: dict[str, str] = tomllib.loads(NOTES.read_text(encoding="utf-8")) if NOTES.exists() else {}
    totals: Counter[str] = Counter()
    rows = []
    for module, statuses in results.items():
        counts = Counter(statuses.values())
        totals.update(counts)
        rows.append(f"| `{module}` | {len(statuses)} | " + " | ".join(str(counts[c]) for c in COLUMNS) + " |")
    out = [
        "# Mutation testing",
        "",
        "`make mutate` (mutmut, configured in `[tool.mutmut]` of pyproject.toml) mutates the security,",
        "redaction and config, rollout-prefix, watch/status and data-plane retry modules and runs, for each",
        "mutant, the tests of the selection that executed the mutated function. Killed: a test failed. Survived:",
        "every test passed (each one is explained below). No tests: no test of the selection runs that function",
        "(listed per module).",
        "",
        *(
            [f"Run: {args.seconds / 60:.1f} min, 2 workers at nice 19; load average at the end {args.load}."]
            if args.seconds is not None
            else []
        ),
        "",
        "| module | mutants | " + " | ".join(COLUMNS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
        *rows,
        f"| **all** | {sum(totals.values())} | " + " | ".join(str(totals[c]) for c in COLUMNS) + " |",
        "",
        "## Survivors",
        "",
    ]
    unexplained = 0
    for statuses in results.values():
        for name, status in statuses.items():
            if status != "survived":
                continue
            note = notes.get(name)
            if note is None:
                unexplained += 1
            out += [f"### `{name}`", "", "```diff", mutant_diff(name), "```", "", note or "UNEXPLAINED", ""]
    out += ["## Not covered by the selected tests", ""]
    for module, statuses in results.items():
        uncovered = sorted({name.split("__mutmut_")[0] for name, s in statuses.items() if s == "no tests"})
        if uncovered:
            out.append(f"* `{module}`: " + ", ".join(f"`{n.rsplit('.', 1)[-1]}`" for n in uncovered))
    out += ["", f"Unexplained survivors: {unexplained}.", ""]
    print("\n".join(out))


if __name__ == "__main__":
    main()
