"""After a drop, a call's resends go out on new connections, never on the pool's other connections to the server,
which may be closing as well (gym_rpc.client.resend._fresh)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import pytest

from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig, GlobalConfig
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

POOLED = 3  # connections the pool holds before the call: as many as the dropped_after_write budget's attempts


class ClosingIdleServer:
    """A server that answers the first request on each connection (keeping the connection) and drops any later
    one unanswered, as a server does that closed an idle keep-alive connection just as the client reused it (or
    died): what a reused connection gets here is a drop after the request was written. The first requests of
    the first POOLED connections are answered together, once all of them are in, so the pool holds POOLED."""

    def __init__(self) -> None:
        self.connections = 0
        self.seen: list[tuple[int, int, str]] = []  # (connection, its request number, "answered" | "dropped")
        self.warm = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        connection, requests = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                requests += 1
                if requests > 1:  # a reused connection: closed under the request
                    self.seen.append((connection, requests, "dropped"))
                    writer.transport.abort()
                    return
                if self.connections >= POOLED:
                    self.warm.set()
                await self.warm.wait()
                self.seen.append((connection, requests, "answered"))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def closing_idle() -> AsyncIterator[tuple[ClosingIdleServer, ServerClient]]:
    server = ClosingIdleServer()
    listener = await asyncio.start_server(server.handle, LOOPBACK, 0)
    port = listener.sockets[0].getsockname()[1]
    doc = document({"tools": server_entry(port, "resources_servers")})  # the default http_client.retry
    client = ServerClient._from_global_config(
        BaseServerConfig(host=LOOPBACK, port=closed_port()), GlobalConfig.from_document(doc)
    )
    try:
        yield server, client
    finally:
        await close_http_sessions()
        listener.close()
        await listener.wait_closed()


async def test_a_call_dropped_on_a_reused_connection_is_resent_on_a_new_one_not_on_the_next_pooled_one(
    closing_idle: tuple[ClosingIdleServer, ServerClient],
) -> None:
    """The pool holds three connections the server will drop when reused (the budget's three attempts). The call
    takes one and is dropped; its resend goes out on a new connection and is answered. Resent on the pool's next
    connections instead, each was dropped the same way and the call failed with ServerDroppedError after 3
    attempts in a few milliseconds."""
    server, client = closing_idle
    warm_up = await asyncio.gather(*(client.post("tools", "/seed_session", json={}) for _ in range(POOLED)))
    for response in warm_up:
        assert response.status == 200 and await response.json() == {}
    assert server.connections == POOLED

    response = await client.post("tools", "/verify", json={"response": "x"})

    assert response.status == 200 and await response.json() == {}
    assert server.seen[POOLED:] == [(server.seen[POOLED][0], 2, "dropped"), (POOLED + 1, 1, "answered")]
    assert server.seen[POOLED][0] <= POOLED  # the first attempt took a pooled connection; the resend, a new one
