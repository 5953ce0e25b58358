"""A data-plane call to a server that accepts and never answers ends at a deadline, by default too, with an error
naming the server and the URL (issue 14, item 7)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from omegaconf import OmegaConf

from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig
from gym_rpc.errors import GymRpcError, RequestTimeoutError
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port


@pytest.fixture
async def mute_server() -> AsyncIterator[tuple[int, list[asyncio.StreamWriter]]]:
    """A loopback port that accepts connections, reads nothing and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, LOOPBACK, 0)
    yield int(server.sockets[0].getsockname()[1]), held
    for writer in held:
        writer.close()
    server.close()
    await close_http_sessions()  # before wait_closed: the server waits for its connections to end
    await server.wait_closed()


def make_client(port: int, **global_keys: Any) -> ServerClient:
    head = BaseServerConfig(host=LOOPBACK, port=closed_port())  # the data plane never needs the head
    doc = document({"policy_model": server_entry(port)}, **global_keys)
    return ServerClient(head_server_config=head, global_config_dict=OmegaConf.create(doc))


def test_data_plane_calls_have_a_default_total_deadline() -> None:
    assert HttpClientSettings().total_timeout_seconds == 1800.0
    assert (
        HttpClientSettings.from_document({"http_client": {"total_timeout_seconds": None}}).total_timeout_seconds
        is None
    )


async def test_the_default_deadline_is_on_the_data_session(mute_server) -> None:
    port, _ = mute_server
    client = make_client(port)
    sessions = client._http.sessions()
    assert sessions.data.timeout.total == 1800.0


async def test_configured_deadline_ends_a_call_to_a_mute_server_naming_server_and_url(mute_server) -> None:
    port, held = mute_server
    client = make_client(port, http_client={"total_timeout_seconds": 0.3})
    started = time.monotonic()
    with pytest.raises(RequestTimeoutError) as caught:
        await client.post("policy_model", "/v1/responses", json={"input": "hi"})
    assert time.monotonic() - started < 10.0  # 0.3 s deadline, generous slack for a loaded machine
    message = str(caught.value)
    assert f"POST http://127.0.0.1:{port}/v1/responses (server 'policy_model')" in message
    assert "got no answer within its deadline (total 0.3 s, connect 10 s);" in message
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, GymRpcError)
    assert len(held) == 1  # a timeout is not retried


async def test_a_per_call_timeout_wins_and_is_named(mute_server) -> None:
    port, _ = mute_server
    client = make_client(port)
    with pytest.raises(RequestTimeoutError, match=r"total 0\.2 s"):
        await client.post("policy_model", "/v1/chat/completions", timeout=aiohttp.ClientTimeout(total=0.2))
