"""The reserved control pool's channels dial connections of their own (`grpc.use_local_subchannel_pool`).

gRPC shares a connection between channels to the same address by default. A channel left redialing a head that
went away (the channel of an event loop that ended, say) then holds every newer channel to that address in its
reconnect backoff: a head started again on the port was refused to a new client for up to the 2 s backoff
("Connection refused", seen in the suite when a new head got a port that a head of an earlier test had had)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from gym_rpc.client.control._channel import close_aio_channels, close_sync_channels, sync_channel
from gym_rpc.client.control._clients import ControlClient
from tests.support.documents import document
from tests.support.loopback import LOOPBACK, closed_port


class CountingProxy:
    """A loopback TCP relay in front of a head: counts the connections dialed through it."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head_reader, head_writer = await asyncio.open_connection(LOOPBACK, self.target_port)
        for task in (self._pipe(reader, head_writer), self._pipe(head_reader, writer)):
            self._tasks.add(asyncio.create_task(task))

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._relay, LOOPBACK, 0)
        try:
            yield f"{LOOPBACK}:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def test_a_client_of_another_event_loop_dials_a_connection_of_its_own(head_factory) -> None:
    head = await head_factory(document({}))
    proxy = CountingProxy(head.port)
    async with proxy.serving() as address:
        await ControlClient(address, timeout_seconds=5.0).list_server_statuses()
        first = proxy.connections  # the head-protocol look's connection and the channel's
        # Another loop in a thread (this loop runs the head and the proxy meanwhile): another channel.
        await asyncio.to_thread(asyncio.run, ControlClient(address, timeout_seconds=5.0).list_server_statuses())
        assert proxy.connections == first + 1  # a connection shared with this loop's channel reads first
        await ControlClient(address, timeout_seconds=5.0).list_server_statuses()
        assert proxy.connections == first + 1  # this loop's channel is still the one reused
        await close_aio_channels()


def test_closing_the_blocking_channels_closes_each_and_the_next_lookup_makes_a_new_one() -> None:
    """`close_sync_channels` (tests, interpreter exit) closes every blocking channel the process keeps and forgets
    them: a later lookup of the address never hands out a closed one. (A channel dials on its first call: none
    is made on the open ones here.)"""
    address = f"{LOOPBACK}:{closed_port()}"
    first = sync_channel(address)
    assert sync_channel(address) is first
    close_sync_channels()
    with pytest.raises(ValueError, match="closed channel"):
        first.unary_unary("/gym_rpc.Test/Call", None, None)(b"", timeout=1)
    again = sync_channel(address)
    assert again is not first
    close_sync_channels()
    assert sync_channel(address) is not again
