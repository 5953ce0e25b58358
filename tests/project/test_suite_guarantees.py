"""The suite's own guarantees against flakes: closed ports stay closed for the test, hypothesis is repeatable, a
child forked beside busy grpc calls gets to exec.

A "closed" port that was bound and released at once could be handed to the next `bind(port 0)` (the head under
test included), turning an expected `connection_error` into something else about one run in seven under load.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from hypothesis import settings

from gym_rpc.client.control._clients import SyncControlClient
from tests.support import REPO_ROOT
from tests.support.cli import let_children_take_sigint
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port


def test_a_closed_port_refuses_connections_at_once() -> None:
    port = closed_port()
    with socket.socket() as client:
        client.settimeout(5)
        assert client.connect_ex((LOOPBACK, port)) == 111  # ECONNREFUSED: nothing listens, nothing hangs


async def test_no_server_on_port_0_is_given_a_held_closed_port() -> None:
    held = {closed_port() for _ in range(64)}
    taken: set[int] = set()
    for _ in range(64):
        server = grpc.aio.server()
        taken.add(server.add_insecure_port(f"{LOOPBACK}:0"))
        await server.stop(None)
        listener = await asyncio.start_server(lambda reader, writer: writer.close(), LOOPBACK, 0)
        taken.add(int(listener.sockets[0].getsockname()[1]))
        listener.close()
        await listener.wait_closed()
    assert held.isdisjoint(taken)


async def test_a_test_may_serve_on_a_held_port_and_get_it_back_after_a_stop() -> None:
    port = closed_port()
    for _ in range(2):  # start, stop, start again on the same port: the reservation outlives each server
        server = grpc.aio.server()
        assert server.add_insecure_port(f"{LOOPBACK}:{port}") == port
        await server.start()
        await server.stop(None)
    with socket.socket() as client:
        assert client.connect_ex((LOOPBACK, port)) == 111  # closed again, still held


def _child_takes_sigint() -> bool:
    """Whether a Python started by this process now turns SIGINT into KeyboardInterrupt (not ignored)."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    answer = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True)
    return answer.stdout.strip() == "True"


def test_subprocesses_take_sigint_even_when_the_suite_was_started_ignoring_it() -> None:
    """The CLI watch tests end `status --watch` with SIGINT: a child that inherited an ignored one never ends."""
    assert _child_takes_sigint()  # however this run was launched
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under `pytest &` in a shell without job control
    try:
        assert not _child_takes_sigint()
        let_children_take_sigint()
        assert _child_takes_sigint()
    finally:
        signal.signal(signal.SIGINT, before)


def _block_sigint() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _exit_codes_of_forked_children(count: int) -> collections.Counter[int]:
    """Start `true` `count` times as Ray starts its GCS and raylet: a preexec_fn makes subprocess really fork()
    (and run the at-fork handlers in the child), where without one it would vfork and run none."""
    codes: collections.Counter[int] = collections.Counter()
    for _ in range(count):
        child = subprocess.Popen(["true"], preexec_fn=_block_sigint)  # as Ray's start_ray_process does
        codes[child.wait(timeout=60)] += 1
    return codes


@pytest.mark.process
async def test_a_child_forked_beside_busy_grpc_calls_gets_to_exec(head_factory) -> None:
    """tests/__init__.py turns gRPC's fork support off before grpc is imported: with it on, grpcio's post-fork
    handler killed about one such child in six before its exec (SIGSEGV, SIGABRT) while a thread of this process
    called a head in the test's loop, as a local Ray's GCS died beside test_ray's head (grpc/grpc#43055)."""
    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "0"
    head = await head_factory(document({"policy": server_entry(closed_port())}))
    client = SyncControlClient(head.address, timeout_seconds=30.0)
    stop = threading.Event()
    calls = 0

    def call_the_head() -> None:
        nonlocal calls
        while not stop.is_set():
            client.list_server_statuses()
            calls += 1

    caller = threading.Thread(target=call_the_head, daemon=True)
    caller.start()
    try:
        codes = await asyncio.to_thread(_exit_codes_of_forked_children, 200)
    finally:
        stop.set()
        await asyncio.to_thread(caller.join, 60)
    assert calls > 0  # the calls were under way while the children forked
    assert codes == {0: 200}  # a child killed before its exec shows as -11 (SIGSEGV) or -6 (SIGABRT)


HANGING_TEARDOWN = """
import asyncio

import pytest


async def wait_for_nothing(never: asyncio.Event) -> None:
    await never.wait()


@pytest.fixture
async def stuck():
    yield
    await wait_for_nothing(asyncio.Event())


def test_stuck_in_teardown(stuck):
    pass
"""


@pytest.mark.process
def test_a_test_past_its_timeout_shows_where_each_task_of_its_loop_waits(tmp_path: Path) -> None:
    """tests/support/hangs.py: pytest-timeout names the threads, and the loop's thread sits in its selector; the
    dump of the loop's tasks names the await that never returned (a fixture's teardown here)."""
    (tmp_path / "test_hanging.py").write_text(HANGING_TEARDOWN, encoding="utf-8")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.support.hangs"]\n', encoding="utf-8")
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        "--timeout",
        "2",
    ]
    result = subprocess.run(
        [*command, "test_hanging.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100
    )

    assert result.returncode == 1, result.stdout + result.stderr
    dump = result.stdout.rpartition("+ Tasks of the running event loop +")[2]
    assert "Timeout (>2.0s) from pytest-timeout" in result.stdout
    assert re.search(
        r'test_hanging.py", line 14, in stuck\n.*test_hanging.py", line 8, in wait_for_nothing\n', dump
    ), dump
    assert re.search(r"in wait\n    awaiting <Future pending", dump), dump  # the Event's own wait, then its future


@pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci", reason="a local fuzzing profile is loaded")
def test_hypothesis_examples_are_derandomised_by_default() -> None:
    assert settings().derandomize is True
    assert settings().database is None  # nothing remembered from an earlier run changes this one


def _tests_named_but_missing(document: str) -> tuple[int, list[str]]:
    """How many `file::test` names (or `::test` after a named file) the document has; those that do not exist.
    A file is named by its path under tests/ (`cli/test_cli.py`), as pytest's node ids name it."""
    tests = REPO_ROOT / "tests"
    modules = {str(path.relative_to(tests)): path for path in tests.rglob("test_*.py")}
    defined = {
        (name, test)
        for name, path in modules.items()
        for test in re.findall(r"^(?:async )?def (test_\w+)", path.read_text(encoding="utf-8"), re.M)
    }
    text = (REPO_ROOT / document).read_text(encoding="utf-8")
    named = re.findall(r"`(?:tests/)?(?:((?:\w+/)*test_\w+\.py)(?:::(test_\w+))?|::(test_\w+))", text)
    current_file = ""
    missing = []
    for file_name, test_in_file, test_after in named:
        if file_name:
            current_file = file_name
            if file_name not in modules:
                missing.append(file_name)
        test = test_in_file or test_after
        if test and (current_file, test) not in defined:
            missing.append(f"{current_file}::{test}")
    return len(named), missing


def test_every_test_docs_promises_names_exists() -> None:
    """docs/PROMISES.md maps each documented promise to its tests: a renamed or deleted test must not leave a
    promise pointing at nothing."""
    named, missing = _tests_named_but_missing("docs/PROMISES.md")
    assert named > 300
    assert missing == []


def test_every_test_security_md_names_exists() -> None:
    """SECURITY.md's "What is defended" table names the test of each line: each of them exists."""
    named, missing = _tests_named_but_missing("SECURITY.md")
    assert named > 20
    assert missing == []


def test_every_defended_line_of_security_md_names_a_test_that_exists() -> None:
    """Each row of SECURITY.md's "What is defended" table names at least one test (that each exists is checked
    above), so no defence is listed without its proof."""
    text = (REPO_ROOT / "SECURITY.md").read_text(encoding="utf-8")
    section = text.split("## What is defended, and the test that proves it", 1)[1].split("\n## ", 1)[0]
    rows = [
        line
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith(("| defended", "| ---"))
    ]
    assert len(rows) > 20
    assert [row for row in rows if not re.search(r"`(?:tests/)?(?:(?:\w+/)*test_\w+\.py)?::test_\w+", row)] == []
