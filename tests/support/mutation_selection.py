"""pytest plugin for `make mutate` (`[tool.mutmut]` in pyproject.toml): keep only the tests of these files.

mutmut maps each mutated function to the tests of its selection that ran it, and resets every cached result when
the selection's arguments change. The selection is therefore `tests/` with this plugin, and the list lives here:
a file added to it (a new module's tests) is picked up as new tests, without re-testing every mutant.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SELECTED_FILES = frozenset(
    {
        "test_config.py",
        "test_config_limits.py",
        "test_security.py",
        "test_head_hardening.py",
        "test_rollout.py",
        "test_middleware.py",
        "test_watch.py",
        "test_watch_fanout.py",
        "test_watch_limits.py",
        "test_watch_client.py",
        "test_leases.py",
        "test_scale.py",
        "test_data_plane.py",
        "test_data_plane_deadline.py",
        "test_server_client.py",
        "test_nemo_gym_behaviours.py",
        "test_registration_hosts.py",
        "test_config_messages.py",
        "test_path_prefixes.py",
        "test_prober_rounds.py",
        "test_probes.py",
        "test_resend_steps.py",
        "test_sessions.py",
        "test_token_check.py",
        "test_watch_resume.py",
        "test_resend_budgets.py",
    }
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Other test files are not even imported (some load tools/, which mutmut does not copy)."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return collection_path.name not in SELECTED_FILES or None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `mutmut run` (rootdir mutants/, beside mutmut's stats), the fastest tests first.

    mutmut runs a mutant's tests with `-x` but in no set order: a killed mutant should cost its fastest killing
    test, not every slow test that happened to come before it.
    """
    stats = config.rootpath / "mutmut-stats.json"
    if not stats.is_file():
        return
    seconds: dict[str, float] = json.loads(stats.read_text(encoding="utf-8")).get("duration_by_test", {})
    items.sort(key=lambda item: seconds.get(item.nodeid, 0.0))


_rootpath = Path()


def pytest_configure(config: pytest.Config) -> None:
    global _rootpath
    _rootpath = config.rootpath


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under `mutmut run`, which test killed which mutant (mutmut keeps only the exit code): one JSON line per
    failed test phase in mutants/mutmut-kills.jsonl, for tools/mutation_report.py."""
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if report.passed or report.skipped or "__mutmut_" not in mutant:
        return
    line = {"mutant": mutant, "test": report.nodeid, "when": report.when, "error": report.longreprtext[-600:]}
    with open(_rootpath / "mutmut-kills.jsonl", "a", encoding="utf-8") as kills:
        kills.write(json.dumps(line) + "\n")
