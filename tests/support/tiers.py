"""The suite's tiers: the `process`, `build` and `load` markers, applied and kept true.

* `process`: the test starts a subprocess (the CLI, a head or a worker in a process of its own, a tool).
* `build`: it builds something slow (a venv, a wheel, Go or npm packages), starts Ray, or smoke-runs a benchmark.
* `load`: it floods the machine or measures times that other work on it would change; `make test` runs these
  alone, after the parallel run.

`make test-fast` runs the rest: in-process tests only. A test is marked by a decorator (`@pytest.mark.process`,
or `pytestmark` for a module), or, for the tests written before the markers existed, by a line of tests/tiers.txt:
`MARKER tests/AREA/test_x.py` (the whole module) or `MARKER tests/AREA/test_x.py::test_name` (every
parametrisation), so that adding the markers did not edit every test module at once. An audit hook watches every
test: one that starts a process while marked none of the three fails, naming the marker it lacks, so the fast tier
cannot quietly start processes. `GYM_RPC_RECORD_PROCESS_TESTS=FILE` writes `process NAME` lines for those tests
into FILE instead of failing them (one run finds them all).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TIERS = ("process", "build", "load")
LISTED = Path(__file__).resolve().parent.parent / "tiers.txt"
RECORD_ENV = "GYM_RPC_RECORD_PROCESS_TESTS"
# Audit events (PEP 578) of a new process: subprocess and asyncio subprocesses, multiprocessing, os.system.
_PROCESS_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system"}
)
_started: list[str] = []
_at_start = pytest.StashKey[int]()


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event in _PROCESS_EVENTS:
        _started.append(event)


sys.addaudithook(_audit)  # for the life of this process: audit hooks cannot be removed


def listed_tiers() -> dict[str, set[str]]:
    """tests/tiers.txt: each marker and the modules (`tests/AREA/test_x.py`) and tests (`::test_x`) it marks."""
    listed: dict[str, set[str]] = {tier: set() for tier in TIERS}
    for number, line in enumerate(LISTED.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            tier, _, name = line.partition(" ")
            if tier not in listed or not name.strip():
                raise ValueError(f"{LISTED}:{number}: expected `MARKER tests/AREA/test_x.py[::test]` ({TIERS})")
            listed[tier].add(name.strip())
    return listed


def node_name(item: pytest.Item) -> str:
    """The item's node id without its parameters: `tests/AREA/test_x.py::node_name`."""
    return item.nodeid.split("[", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    listed = listed_tiers()
    for item in items:
        name = node_name(item)
        for tier, names in listed.items():
            if name in names or name.partition("::")[0] in names:
                item.add_marker(tier)
    items.sort(key=_slowest_modules_first(items))


def _slowest_modules_first(items: list[pytest.Item]) -> Callable[[pytest.Item], tuple[int, int, int]]:
    """Sort key: modules with a build first, then those with the most tests that start processes (each start costs
    a second or more), then (in-process modules, and all of `make test-fast`) those with the most tests, as xdist's
    own order; each module keeps its own order. `make test` hands whole modules to
    the parallel workers in this order (`--dist loadscope --no-loadscope-reorder`), so the long ones start first
    and the short ones fill the gaps at the end. xdist's own order (most tests first) handed the build modules out
    late, having few tests: Ray's and the lowest-versions venv's 76th and 77th of 107 modules."""
    builds: dict[str, int] = {}
    processes: dict[str, int] = {}
    tests: dict[str, int] = {}
    for item in items:
        module = node_name(item).partition("::")[0]
        builds[module] = builds.get(module, 0) + (item.get_closest_marker("build") is not None)
        processes[module] = processes.get(module, 0) + any(item.get_closest_marker(t) for t in TIERS)
        tests[module] = tests.get(module, 0) + 1
    return lambda item: (
        -min(builds[module := node_name(item).partition("::")[0]], 1),
        -processes[module],
        -tests[module],
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    item.stash[_at_start] = len(_started)  # before setup: a module fixture's process counts for its first test
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    result = yield
    started = _started[item.stash.get(_at_start, len(_started)) :]
    if started and not any(item.get_closest_marker(tier) for tier in TIERS):
        record = os.environ.get(RECORD_ENV)
        if record:
            with open(record, "a", encoding="utf-8") as out:
                out.write(f"process {node_name(item)}\n")
        else:
            pytest.fail(
                f"{item.nodeid} started a process ({started[0]}) but is marked none of {', '.join(TIERS)}: "
                "mark it @pytest.mark.process (or build / load), so `make test-fast` leaves it out",
                pytrace=False,
            )
    return result
