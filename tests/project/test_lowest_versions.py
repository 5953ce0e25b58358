"""gym_rpc works with the lowest version of each runtime dependency that pyproject.toml declares.

tools/lowest_versions_venv.py builds (once) a venv with exactly those floors; the test files listed in
tests/lowest_versions.txt run there, as they run here. A floor the code has outgrown fails this test, so a declared
floor is a tested one.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import ModuleType

import pytest
from packaging.version import Version

from tests.support import REPO_ROOT

BUILDER = REPO_ROOT / "tools" / "lowest_versions_venv.py"
LISTED = REPO_ROOT / "tests" / "lowest_versions.txt"
BUILD_TIMEOUT_SECONDS = 900  # a first build on a fresh machine downloads the old releases
RUN_TIMEOUT_SECONDS = 600
# On workers of their own: run in one process, the listed files took 300 s at load 15, the longest test of the
# parallel run (which then took 465 s), so the whole suite waited on them.
LISTED_WORKERS = ("-n", "3", "--dist", "loadscope")


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lowest_versions_venv", BUILDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listed_files() -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in LISTED.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line]


@pytest.fixture(scope="module")
def lowest_python() -> str:
    built = subprocess.run(
        [sys.executable, str(BUILDER)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS
    )
    assert built.returncode == 0, f"building the lowest-versions venv failed:\n{built.stderr[-4000:]}"
    return built.stdout.strip().splitlines()[-1]


def test_every_listed_file_exists() -> None:
    files = listed_files()
    assert files and [name for name in files if not (REPO_ROOT / name).is_file()] == []


def test_every_runtime_dependency_states_its_floor() -> None:
    floors = _builder().floors()  # raises naming a requirement without `>=`
    assert any(name.startswith("grpcio==") for name in floors) and any(n.startswith("protobuf==") for n in floors)


_INSTALLED = (
    "import json, importlib.metadata as m; "
    "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version for d in m.distributions()}))"
)


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + 60)
def test_the_venv_holds_exactly_the_floors(lowest_python: str) -> None:
    listed = subprocess.run([lowest_python, "-c", _INSTALLED], capture_output=True, text=True, timeout=60)
    installed = json.loads(listed.stdout)
    floors = dict(line.split("==") for line in _builder().floors())
    off = {
        name: installed.get(name.lower())
        for name, version in floors.items()
        if installed.get(name.lower()) is None or Version(installed[name.lower()]) != Version(version)
    }
    assert off == {}


@pytest.mark.timeout(BUILD_TIMEOUT_SECONDS + RUN_TIMEOUT_SECONDS)
def test_the_listed_tests_pass_on_the_lowest_versions(lowest_python: str) -> None:
    run = subprocess.run(
        [lowest_python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *LISTED_WORKERS, *listed_files()],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_SECONDS,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 0, f"on the lowest versions:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
