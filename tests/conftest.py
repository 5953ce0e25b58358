"""Real parts on loopback: a grpc.aio head on a free port, aiohttp servers, sockets that never answer.

The head runs in the test's event loop, so blocking (SyncControlClient / ServerClient sync) calls from a test
must go through `asyncio.to_thread`, or the loop that serves them would be blocked by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
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
from tests.support.tiers import (  # noqa: F401  (hooks: the process/build/load markers, kept true)
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
    pytest_runtest_teardown,
)

LOOPBACK = "127.0.0.1"

# Hypothesis: the suite (CI included) runs a fixed, derandomised set of examples, so a red run can be re-run and a
# green one means the same thing everywhere; `HYPOTHESIS_PROFILE=fuzz` explores far more, randomly, when fuzzing
# by hand (`HYPOTHESIS_PROFILE=fuzz .venv/bin/python -m pytest tests/test_fuzz.py`).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", max_examples=3000, derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def let_children_take_sigint() -> None:
    """Give this process Python's own SIGINT handler when SIGINT was inherited ignored.

    A suite started with SIGINT ignored (a bare `cmd &` in a shell without job control: SigIgn 0x6) would pass the
    ignore on to every subprocess it starts, and a `gym-rpc status --watch` that ignores Ctrl-C never ends when a
    test sends it SIGINT. A handler (unlike an ignore) is reset to the default by exec, so every child starts as
    from a terminal, whatever way the suite was launched.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


let_children_take_sigint()


_held_ports: list[socket.socket] = []


def closed_port(host: str = LOOPBACK) -> int:
    """A loopback port that stays closed for the whole test: a socket bound to it, never listening.

    Connecting to it is refused at once, and no `bind(port 0)` anywhere on the machine (the head under test
    included) can be given it while it is held, as could happen to a port bound and released at once. The socket
    has SO_REUSEADDR, so a test may still start a server on this very port on purpose (a head "coming back") and
    keep the port through a stop and restart. Each socket is closed when the test (or the module, for a
    module-scoped fixture) that took it ends.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    _held_ports.append(sock)
    return int(sock.getsockname()[1])


def _release_ports_held_since(mark: int) -> None:
    while len(_held_ports) > mark:
        _held_ports.pop().close()


@pytest.fixture(autouse=True, scope="module")
def _release_module_closed_ports() -> Iterator[None]:
    """Ports held by module-scoped fixtures stay closed until the module ends (autouse runs before them)."""
    mark = len(_held_ports)
    yield
    _release_ports_held_since(mark)


@pytest.fixture(autouse=True)
def _release_closed_ports() -> Iterator[None]:
    """Ports held during a test stay closed until it ends, then are released."""
    mark = len(_held_ports)
    yield
    _release_ports_held_since(mark)


def tcp_keepalive_options(sock: socket.socket) -> list[int]:
    """A socket's SO_KEEPALIVE, TCP_KEEPIDLE, TCP_KEEPINTVL and TCP_KEEPCNT (Linux)."""
    return [
        sock.getsockopt(level, option)
        for level, option in (
            (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        )
    ]


def server_entry(port: int, server_type: str = "responses_api_models", host: str = LOOPBACK, **extra: Any) -> dict:
    """`{server_type: {impl: {host, port, ...}}}` for a config document."""
    return {server_type: {f"{server_type}_impl": {"host": host, "port": port, **extra}}}


def document(servers: dict[str, dict], **global_keys: Any) -> dict[str, Any]:
    return {"head_server": {"host": LOOPBACK, "port": 0}, **servers, **global_keys}


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
        path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True), encoding="utf-8")
        options = {"port": 0, "probe_interval_seconds": 0.1, "probe_timeout_seconds": 0.5, **options}
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


class LoopStallDetector:
    """Measures the longest time the running event loop went without running a 5 ms ticker.

    A blocking call made on the loop (a control call to a head this same loop serves, say) shows up as a stall as
    long as the call's own deadline, far above anything scheduling noise causes.
    """

    def __init__(self) -> None:
        self.longest_stall = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.005)
            now = loop.time()
            self.longest_stall = max(self.longest_stall, now - last)
            last = now

    async def __aenter__(self) -> LoopStallDetector:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)  # the ticker runs from here on
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
