"""The suite's tiers stay true (tests/support/tiers.py): a test that starts a process unmarked fails, naming the
marker; every name tests/tiers.txt lists exists; `make test-fast` selects what the markers leave. And the suite's
shape: no module of tests/ imports a test module or a conftest (what two modules share lives in tests/support)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.tiers import RECORD_ENV, TIERS, listed_tiers

ROOT = REPO_ROOT

_CONFTEST = (
    "from tests.support.tiers import pytest_collection_modifyitems, pytest_runtest_protocol, "
    "pytest_runtest_teardown  # noqa: F401\n"
)
_TESTS = """
import subprocess
import sys

import pytest


def test_in_process():
    assert sum(range(4)) == 6


def test_starts_a_process_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.process
def test_starts_a_process_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.fixture(scope="module")
def child():
    return subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True).stdout


def test_a_module_fixture_starts_it(child):
    assert child == "7\\n"
"""


def _run_suite(folder: Path, *args: str, record: Path | None = None) -> subprocess.CompletedProcess[str]:
    """pytest on a sample suite with the tiers hooks; `record`: GYM_RPC_RECORD_PROCESS_TESTS (else unset, even
    when this run records)."""
    env = {name: value for name, value in os.environ.items() if name != RECORD_ENV}
    if record is not None:
        env[RECORD_ENV] = str(record)
    (folder / "conftest.py").write_text(_CONFTEST, encoding="utf-8")
    (folder / "test_sample.py").write_text(_TESTS, encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        *args,
        str(folder),
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env, check=False)


@pytest.mark.process
def test_a_test_that_starts_a_process_unmarked_fails_naming_the_marker(tmp_path: Path) -> None:
    result = _run_suite(tmp_path, "--rootdir", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    errors = sorted(re.findall(r"^ERROR \S+::(\w+)", result.stdout, re.M))
    # A module fixture's process counts for the first test that uses it.
    assert errors == ["test_a_module_fixture_starts_it", "test_starts_a_process_unmarked"], result.stdout
    assert "mark it @pytest.mark.process" in result.stdout
    # Every call passes; the two unmarked ones then fail at teardown, where the hook sees what they started.
    assert re.search(r"^4 passed, .*2 errors", result.stdout, re.M), result.stdout


@pytest.mark.process
def test_the_unmarked_ones_can_be_recorded_instead(tmp_path: Path) -> None:
    record = tmp_path / "recorded.txt"
    folder = tmp_path / "suite"
    folder.mkdir()
    result = _run_suite(folder, "--rootdir", str(folder), record=record)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(record.read_text().splitlines()) == [
        "process test_sample.py::test_a_module_fixture_starts_it",
        "process test_sample.py::test_starts_a_process_unmarked",
    ]


def _module(*tests: tuple[str, str]) -> str:
    """A test module of empty tests, each `(marker or "", name)`."""
    return "import pytest\n" + "".join(
        f"\n{f'@pytest.mark.{marker}' if marker else ''}\ndef test_{name}():\n    pass\n" for marker, name in tests
    )


@pytest.mark.process
def test_modules_with_builds_then_with_the_most_processes_are_handed_out_first(tmp_path: Path) -> None:
    """Parallel workers take whole modules in collection order (`--no-loadscope-reorder`): a module with a build
    first, then the one with more tests that start processes, in-process ones last, each in its own order. xdist's
    own order (by number of tests) would hand out the in-process module of three tests first."""
    (tmp_path / "conftest.py").write_text(_CONFTEST, encoding="utf-8")
    (tmp_path / "test_a_in_process.py").write_text(_module(("", "1"), ("", "2"), ("", "3")), encoding="utf-8")
    (tmp_path / "test_b_processes.py").write_text(_module(("process", "1"), ("process", "2")), encoding="utf-8")
    (tmp_path / "test_c_build.py").write_text(
        _module(("", "first"), ("build", "built"), ("process", "started")), encoding="utf-8"
    )
    command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-p", "no:xdist"]
    result = subprocess.run(
        [*command, "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert collected == [
        "test_c_build.py::test_first",
        "test_c_build.py::test_built",
        "test_c_build.py::test_started",
        "test_b_processes.py::test_1",
        "test_b_processes.py::test_2",
        "test_a_in_process.py::test_1",
        "test_a_in_process.py::test_2",
        "test_a_in_process.py::test_3",
    ], result.stdout + result.stderr
    parallel = re.search(r"^PYTEST_PARALLEL := (.*)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert parallel is not None and "--dist loadscope --no-loadscope-reorder" in parallel.group(1)


def test_every_module_and_test_tiers_txt_lists_exists() -> None:
    listed = listed_tiers()
    assert set(listed) == set(TIERS)
    missing = []
    for names in listed.values():
        for name in names:
            path, _, test = name.partition("::")
            module = ROOT / path
            if not module.is_file() or (
                test and not re.search(rf"^(?:async )?def {test}\(", module.read_text(encoding="utf-8"), re.M)
            ):
                missing.append(name)
    assert missing == []
    assert listed["process"], "the tests that start processes are listed"


def test_the_markers_are_registered_and_make_test_fast_leaves_them_out() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    fast = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert fast is not None
    assert '-m "not process and not build and not load"' in fast.group(1)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for tier in TIERS:
        assert re.search(rf'^    "{tier}: ', pyproject, re.M), tier


def _is_test_module(module: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in module.split("."))


def _imported_test_modules(source: str) -> list[str]:
    """The test modules (`test_*`) and conftests a module's source imports, as written (relative ones included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            modules = (
                [base] if _is_test_module(base) else [f"{base.rstrip('.')}.{alias.name}" for alias in node.names]
            )
        else:
            continue
        found += [module for module in modules if _is_test_module(module) and module not in found]
    return found


def test_the_import_finder_sees_every_way_of_importing_a_test_module() -> None:
    """The finder below catches what it checks (a finder that saw nothing would make the next test pass)."""
    source = """
import tests.test_watch
from tests.test_cli import write_config
from tests import test_security
from .test_metrics import scrape
from tests.conftest import closed_port
from tests.support.heads import watching
import pytest
"""
    assert _imported_test_modules(source) == [
        "tests.test_watch",
        "tests.test_cli",
        "tests.test_security",
        ".test_metrics",
        "tests.conftest",
    ]


def test_no_module_of_the_suite_imports_a_test_module() -> None:
    """Each test module reads as a specification on its own: what two of them share (servers, heads, the CLI, the
    PKI, waiting) lives in tests/support, and fixtures in tests/conftest.py, never in another test module."""
    importing = {
        str(path.relative_to(ROOT)): imported
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (imported := _imported_test_modules(path.read_text(encoding="utf-8")))
    }
    assert len(list((ROOT / "tests").rglob("test_*.py"))) > 90  # the walk found the suite
    assert importing == {}
