"""Real parts on loopback: a grpc.aio head on a free port, aiohttp servers, sockets that never answer.

The head runs in the test's event loop, so blocking (SyncControlClient / ServerClient sync) calls from a test
must go through `asyncio.to_thread`, or the loop that serves them would be blocked by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from gym_rpc.client._channel import close_aio_channels, close_sync_channels
from gym_rpc.config import GlobalConfig
from gym_rpc.server._head import HeadOptions, HeadServer

LOOPBACK = "127.0.0.1"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


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
    for head in heads:
        await head.stop()


@pytest.fixture(autouse=True)
def _close_sync_channels() -> Any:
    yield
    with contextlib.suppress(Exception):
        close_sync_channels()
