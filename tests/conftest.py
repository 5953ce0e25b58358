"""Real parts on loopback: a grpc.aio head on a free port, aiohttp servers, sockets that never answer.

The head runs in the test's event loop, so blocking (SyncControlClient / ServerClient sync) calls from a test
must go through `asyncio.to_thread`, or the loop that serves them would be blocked by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from hypothesis import settings

from gym_rpc.client._follower import close_instance_followers
from gym_rpc.client.control._channel import close_aio_channels, close_sync_channels
from gym_rpc.config import GlobalConfig
from gym_rpc.server._head import HeadOptions, HeadServer
from tests.support.cli import let_children_take_sigint
from tests.support.loopback import LOOPBACK, ports_held, release_ports_held_since
from tests.support.tiers import (  # noqa: F401  (hooks: the process/build/load markers, kept true)
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
    pytest_runtest_teardown,
)

# The fixtures several modules share, beside their helpers in tests/support (no test module imports another).
pytest_plugins = [
    "tests.support.bridge",
    "tests.support.fd_limits",
    "tests.support.hangs",
    "tests.support.nemo_gym",
    "tests.support.processes",
    "tests.support.replicas",
    "tests.support.security",
    "tests.support.tracing",
]

# Hypothesis: the suite (CI included) runs a fixed, derandomised set of examples, so a red run can be re-run and a
# green one means the same thing everywhere; `HYPOTHESIS_PROFILE=fuzz` explores far more, randomly, when fuzzing
# by hand (`HYPOTHESIS_PROFILE=fuzz .venv/bin/python -m pytest tests/config/test_fuzz.py`).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", max_examples=3000, derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


let_children_take_sigint()


@pytest.fixture(autouse=True, scope="module")
def _release_module_closed_ports() -> Iterator[None]:
    """Ports held by module-scoped fixtures stay closed until the module ends (autouse runs before them)."""
    mark = ports_held()
    yield
    release_ports_held_since(mark)


@pytest.fixture(autouse=True)
def _release_closed_ports() -> Iterator[None]:
    """Ports held during a test stay closed until it ends, then are released."""
    mark = ports_held()
    yield
    release_ports_held_since(mark)


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@pytest.fixture
async def http_server() -> AsyncIterator[Callable[..., Awaitable[int]]]:
    """Factory: start an aiohttp app on a free loopback port and return the port. Default app answers 200."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application | None = None) -> int:
        if app is None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", _ok)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, 0)
        await site.start()
        runners.append(runner)
        return int(runner.addresses[0][1])

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def silent_server() -> AsyncIterator[int]:
    """A port that accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, LOOPBACK, 0)
    yield int(server.sockets[0].getsockname()[1])
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.fixture
async def malformed_server() -> AsyncIterator[int]:
    """Answers every request with a line that is not an HTTP status line: the probe can only say unknown_error."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(b"NOT-HTTP nonsense\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, LOOPBACK, 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()
    await server.wait_closed()


@pytest.fixture
async def head_factory(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[HeadServer]]]:
    """Factory: start a HeadServer serving `doc` (written to a file, so reload works) on a free port."""
    heads: list[HeadServer] = []

    async def start(doc: dict[str, Any], **options: Any) -> HeadServer:
        path = tmp_path / f"config{len(heads)}.yaml"
        # libyaml's emitter: the pure-Python one took most of a minute on a 4 MiB config at load 9
        text = yaml.dump(doc, Dumper=yaml.CSafeDumper, sort_keys=False, allow_unicode=True)
        path.write_text(text, encoding="utf-8")
        # Probes of 5 s: the head shares the test's event loop with the servers it probes, and on a loaded machine
        # a stall of the loop past 0.5 s (the old default) reported live servers as timed out. A test of the
        # timeout itself sets its own (or bounds the probe by its call's deadline).
        options = {"port": 0, "probe_interval_seconds": 0.1, "probe_timeout_seconds": 5.0, **options}
        head = HeadServer(GlobalConfig.from_document(doc), HeadOptions(**options), config_path=path)
        await head.start()
        heads.append(head)
        return head

    yield start
    await close_aio_channels()
    if heads:
        # A follower's watch still open would hold each head's stop for its whole shutdown grace (0.5 s).
        await asyncio.to_thread(close_instance_followers)
    for head in heads:
        await head.stop()


@pytest.fixture(autouse=True)
def _close_sync_channels() -> Any:
    yield
    with contextlib.suppress(Exception):
        close_sync_channels()
    close_instance_followers()  # the background followers of the heads this test's clients called
