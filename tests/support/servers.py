"""Loopback HTTP servers shared by test modules and the scenario scripts they run in fresh interpreters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from tests.support.loopback import LOOPBACK


async def _ok(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"ok": True})


async def start_ok_server(
    middlewares: Sequence[Any] = (), setup: Callable[[web.Application], object] | None = None
) -> tuple[web.AppRunner, int]:
    """An aiohttp server answering every method and path with {"ok": true}; `setup(app)` runs before it starts."""
    app = web.Application(middlewares=list(middlewares))
    if setup is not None:
        setup(app)
    app.router.add_route("*", "/{tail:.*}", _ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    return runner, int(runner.addresses[0][1])


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


async def start_dropping_server(drops: int | Callable[[int], bool]) -> tuple[asyncio.Server, int, list[int]]:
    """A raw HTTP server that reads and then drops the first `drops` connections without answering (or those whose
    number, from 1, `drops` picks), and answers 200 on the others. Returns the server, its port and a one-item list
    counting the connections."""
    connections = [0]
    dropped = drops if callable(drops) else lambda number: number <= drops

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            if not head.startswith(b"POST "):
                # not the test's call (every user POSTs): a stray from another xdist worker, such as a head's
                # probe (GET /) of a port its test let go that this server was then given; it counted a 4th
                # connection in test_resend_is_bounded under load
                return
            connections[0] += 1
            # The whole request, body included, before the drop: a drop while the client still writes its body
            # would be a drop *before* the request was written, a resend kind of its own (a 4th connection).
            await asyncio.wait_for(reader.readexactly(_content_length(head)), 5)
            if not dropped(connections[0]):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, LOOPBACK, 0)
    return server, int(server.sockets[0].getsockname()[1]), connections


async def start_stoppable_server() -> tuple[web.AppRunner, int]:
    """An aiohttp server the test itself stops (the shared http_server fixture keeps its servers to the end)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()
    return runner, int(runner.addresses[0][1])


class CountingServer:
    """An aiohttp server that counts the requests it receives and, while `hold` is clear, does not answer."""

    def __init__(self) -> None:
        self.requests = 0
        self.hold = asyncio.Event()
        self.hold.set()

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        await asyncio.wait_for(self.hold.wait(), 30)
        return web.Response(text="ok")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")
