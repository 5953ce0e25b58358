"""Build (once) a venv with every runtime dependency of gym_rpc at the lowest version pyproject.toml declares, and
print its python; tests/project/test_lowest_versions.py runs the files tests/lowest_versions.txt lists there.

A floor that is declared but never installed is a guess. Here each `name>=X` of the base install and of the `head`
extra (the tests start heads) is installed as `name==X`; what those pull in comes as pip resolves it, and the test
tools come as `[dev]` names them. The venv (`.venv-lowest/`) is rebuilt only when the floors, the test tools or the
interpreter change (a stamp holds their digest), so after the first build (a few minutes) it costs nothing.

    python tools/lowest_versions_venv.py           # build or reuse; the last line is the venv's python
    python tools/lowest_versions_venv.py --floors  # print the pinned floors only
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_DIR = REPO_ROOT / ".venv-lowest"
STAMP = VENV_DIR / ".stamp"
LOCK = REPO_ROOT / ".venv-lowest.lock"  # git-ignored
PYPROJECT = REPO_ROOT / "pyproject.toml"
EXTRAS_AT_FLOOR = ("head",)  # the tests start heads in-process and as `gym-rpc head`
TEST_TOOLS = (
    "pytest",
    "pytest-asyncio",
    "pytest-timeout",
    "pytest-xdist",  # the listed files run on 3 workers: alone they were the longest test of `make test`
    "hypothesis",
    "cryptography",
    "requests",
    "opentelemetry-instrumentation-aiohttp-client",  # tests/support/scenarios/tracing_fit.py
    # tests/client/tracing/test_telemetry.py: a collector on loopback (its OTLP export tests skip here)
    "opentelemetry-proto",
)
_FLOOR = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)\s*>=\s*(?P<version>[^,;\s]+)")
_NAME = re.compile(r"^[A-Za-z0-9._-]+")


def _project() -> dict[str, Any]:
    with PYPROJECT.open("rb") as file:
        project: dict[str, Any] = tomllib.load(file)["project"]
    return project


def floors() -> list[str]:
    """`name==X` for each runtime requirement `name>=X` (base and EXTRAS_AT_FLOOR); a requirement without a floor
    is an error: every runtime dependency must state its lowest supported version."""
    project = _project()
    requirements = list(project["dependencies"])
    for extra in EXTRAS_AT_FLOOR:
        requirements += [r for r in project["optional-dependencies"][extra] if not r.startswith("gym-rpc")]
    pinned = []
    for requirement in requirements:
        match = _FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"pyproject.toml: {requirement!r} states no lowest version (name>=X)")
        pinned.append(f"{match.group('name')}=={match.group('version')}")
    return pinned


def test_tools() -> list[str]:
    """The test tools, as [dev] names them (their own versions are not what is tested here)."""
    dev = _project()["optional-dependencies"]["dev"]
    by_name = {m.group(0).lower(): r for r in dev if (m := _NAME.match(r))}
    return [by_name.get(name, name) for name in TEST_TOOLS]


def _digest() -> str:
    """What the venv is made of: the floors, the test tools and the interpreter (another change to pyproject.toml,
    or to the code, needs no rebuild: gym_rpc is installed editable)."""
    return hashlib.sha256("\n".join([*floors(), *test_tools(), sys.executable]).encode()).hexdigest()


def build() -> Path:
    """The venv's python, building the venv first unless its stamp says it is up to date.

    One build at a time: parallel test workers (pytest-xdist) may each ask for the venv, and the second must wait
    for the first's stamp instead of deleting the venv it is building. The lock is a file beside the venv."""
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _build_unlocked()


def _build_unlocked() -> Path:
    python = VENV_DIR / "bin" / "python"
    wanted = _digest()
    if python.exists() and STAMP.exists() and STAMP.read_text() == wanted:
        return python
    shutil.rmtree(VENV_DIR, ignore_errors=True)
    print(f"building {VENV_DIR} with the lowest declared versions", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV_DIR)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-warn-conflicts"]
    subprocess.run([*pip, *floors(), *test_tools()], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(REPO_ROOT)], check=True)
    STAMP.write_text(wanted)
    return python


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--floors", action="store_true", help="print the pinned floors and exit")
    if parser.parse_args().floors:
        print("\n".join(floors()))
        return 0
    print(build())
    return 0


if __name__ == "__main__":
    sys.exit(main())
