"""ServerClient's data plane against real aiohttp and raw asyncio servers: rollout prefixes, bodies, IPv6, the
reserved control pool, resend and unreachable semantics, and clean closing."""

from __future__ import annotations

import asyncio
import gc
import inspect
import socket
import time
import unittest.mock
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from omegaconf import OmegaConf
from pydantic import BaseModel

from gym_rpc.client.data import _http as http
from gym_rpc.client.data._call_paths import ROLLOUT_PATHS_LIMIT, path_rule, rollout_paths
from gym_rpc.client.data._http import close_http_sessions
from gym_rpc.client.data._http_settings import HttpClientSettings
from gym_rpc.client.server_client import ServerClient, rollout_context
from gym_rpc.config import BaseServerConfig, GlobalConfig
from gym_rpc.errors import GymRpcError, InvalidRolloutIdError, RequestTimeoutError, ServerUnreachableError
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port
from tests.support.servers import start_dropping_server
from tests.support.waiting import eventually

FAST_RETRY = {"retry": {"initial_backoff_seconds": 0.01, "max_backoff_seconds": 0.05}}


@pytest.fixture(autouse=True)
async def _close_sessions() -> AsyncIterator[None]:
    yield
    await close_http_sessions()


def make_client(servers: dict[str, dict], **global_keys: Any) -> ServerClient:
    head = BaseServerConfig(host=LOOPBACK, port=closed_port())  # the data plane never needs the head
    return ServerClient(
        head_server_config=head, global_config_dict=OmegaConf.create(document(servers, **global_keys))
    )


class Recorder:
    """An aiohttp app that records the raw path (and JSON body) of every request it receives."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.bodies: list[Any] = []
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.record)

    async def record(self, request: web.Request) -> web.Response:
        self.paths.append(request.raw_path)
        self.bodies.append(await request.json() if request.can_read_body else None)
        return web.json_response({"ok": True})


async def call(client: ServerClient, server: str, path: str, **kwargs: Any) -> int:
    async with await client.post(server, path, **kwargs) as response:
        await response.read()
        return response.status


# --- rollout prefixes and bodies ---------------------------------------------------------------------------------


async def test_rollout_prefixes_reach_the_server(http_server) -> None:
    recorder = Recorder()
    port = await http_server(recorder.app)
    servers = {
        "policy": server_entry(port),
        "tools": server_entry(port, "resources_servers"),
        "agent": server_entry(port, "responses_api_agents"),
    }
    client = make_client(servers, observability_enabled=True)
    with rollout_context("r-42"):
        await call(client, "policy", "/v1/responses")
        await call(client, "policy", "/v1/chat/completions")
        await call(client, "policy", "/health")  # not a model API path
        await call(client, "tools", "/verify")  # every resources-server path
        await call(client, "agent", "/run")
        await call(client, "policy", "/ng-rollout/r-42/v1/responses")  # never doubled
    with rollout_context("task-9.r_2"):
        await call(client, "policy", "/v1/messages")
    await call(client, "policy", "/v1/responses")  # no rollout bound
    assert recorder.paths == [
        "/ng-rollout/r-42/v1/responses",
        "/ng-rollout/r-42/v1/chat/completions",
        "/health",
        "/ng-rollout/r-42/verify",
        "/run",
        "/ng-rollout/r-42/v1/responses",
        "/ng-rollout/task-9.r_2/v1/messages",
        "/v1/responses",
    ]


async def test_a_rollouts_repeated_calls_keep_their_own_paths(http_server) -> None:
    """A client remembers the path each rollout's calls were given (RolloutPaths): a call of another rollout, to
    another server or path, or with a query string, still gets its own; a call without a rollout gets none."""
    recorder = Recorder()
    port = await http_server(recorder.app)
    servers = {"policy": server_entry(port), "tools": server_entry(port, "resources_servers")}
    client = make_client(servers, observability_enabled=True)
    for rollout_id in ("r-1", "r-2", "r-1"):
        with rollout_context(rollout_id):
            for _ in range(2):
                await call(client, "policy", "/v1/responses")
            await call(client, "policy", "/v1/responses?stream=false")
            await call(client, "tools", "/verify")
        await call(client, "policy", "/v1/responses")
        await call(client, "tools", "/verify", json={"_ng_rollout_id": f"body-{rollout_id}"})
    expected = []
    for rollout_id in ("r-1", "r-2", "r-1"):
        expected += [
            f"/ng-rollout/{rollout_id}/v1/responses",
            f"/ng-rollout/{rollout_id}/v1/responses",
            f"/ng-rollout/{rollout_id}/v1/responses?stream=false",
            f"/ng-rollout/{rollout_id}/verify",
            "/v1/responses",
            f"/ng-rollout/body-{rollout_id}/verify",
        ]
    assert recorder.paths == expected


def test_rollout_paths_are_bounded_and_keep_no_refused_id() -> None:
    servers = {"policy": server_entry(1), "tools": server_entry(1, "resources_servers")}
    config = GlobalConfig.from_document(document(servers, observability_enabled=True))
    paths = rollout_paths(config, path_rule(config))
    assert paths is not None
    for index in range(ROLLOUT_PATHS_LIMIT + 10):
        assert paths[f"r{index}", "policy", "/v1/responses"] == f"/ng-rollout/r{index}/v1/responses"
        assert len(paths) <= ROLLOUT_PATHS_LIMIT
    assert paths["r1", "tools", "/verify"] == "/ng-rollout/r1/verify"
    assert paths["r1", "policy", "/health"] == "/health"
    held = len(paths)
    for _ in range(2):  # refused each time, the typed error of the rule, and nothing kept
        with pytest.raises(InvalidRolloutIdError):
            paths["not one/segment", "policy", "/v1/responses"]
    assert len(paths) == held
    # a client with engine entries adds a header to each call instead: nothing to remember
    engines = GlobalConfig.from_document(
        document({"policy": server_entry(1, session_affinity_header="x-session-id")}, observability_enabled=True)
    )
    assert rollout_paths(engines, path_rule(engines)) is None
    plain = GlobalConfig.from_document(document({"policy": server_entry(1)}))
    assert rollout_paths(plain, path_rule(plain)) is None


async def test_no_prefix_without_observability(http_server) -> None:
    recorder = Recorder()
    port = await http_server(recorder.app)
    for flag in ({}, {"observability_enabled": False}):
        client = make_client(
            {"policy": server_entry(port), "tools": server_entry(port, "resources_servers")}, **flag
        )
        with rollout_context("r-1"):
            await call(client, "policy", "/v1/responses")
            await call(client, "tools", "/verify")
    assert recorder.paths == ["/v1/responses", "/verify"] * 2


class Body(BaseModel):
    model: str = "default-model"
    temperature: float | None = None
    input: list[str] = []


async def test_pydantic_body_sent_without_unset_fields(http_server) -> None:
    recorder = Recorder()
    client = make_client({"policy": server_entry(await http_server(recorder.app))})
    await call(client, "policy", "/v1/responses", json=Body(input=["hi"], temperature=None))
    await call(client, "policy", "/v1/responses", json={"plain": "dict"})
    assert recorder.bodies == [{"input": ["hi"], "temperature": None}, {"plain": "dict"}]


class HeaderAddingClient(ServerClient):
    """A subclass that overrides `request`, as NeMo Gym users do to add headers: `post` and `get` go through it."""

    async def request(  # type: ignore[override]  # the seed's signature, with its kwargs as a plain dict
        self, server_name: str, url_path: str, method: str, **kwargs: Any
    ) -> aiohttp.ClientResponse:
        kwargs["headers"] = {"X-Added": method}
        return await super().request(server_name, url_path, method, **kwargs)


class HeaderRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.added: list[str | None] = []

    async def record(self, request: web.Request) -> web.Response:
        self.added.append(request.headers.get("X-Added"))
        return await super().record(request)


async def test_post_and_get_go_through_a_subclass_request(http_server) -> None:
    recorder = HeaderRecorder()
    port = await http_server(recorder.app)
    plain = make_client({"policy": server_entry(port)})
    subclassed = HeaderAddingClient(
        head_server_config=plain.head_server_config, global_config_dict=plain.global_config_dict
    )
    for _ in range(2):  # the first call and those after it (a plain client's later calls take a shorter way)
        await call(subclassed, "policy", "/v1/responses", json={"a": 1})
        async with await subclassed.get("policy", "/health") as response:
            await response.read()
        await call(plain, "policy", "/v1/responses", json={"a": 1})
    assert recorder.added == ["POST", "GET", None] * 2
    assert recorder.bodies[0] == {"a": 1}


class PostOverridingClient(ServerClient):
    """A subclass that overrides `post` itself and calls the library's through `super()`."""

    async def post(self, server_name: str, url_path: str, **kwargs: Any) -> aiohttp.ClientResponse:
        kwargs["headers"] = {"X-Added": "post override"}
        return await super().post(server_name, url_path, **kwargs)


async def test_post_and_get_read_as_coroutine_functions_with_the_seed_signature(http_server) -> None:
    """`client.post` is the hot path with the method bound (no coroutine of its own); read on the class or on a
    client it still looks and behaves as the `async def` NeMo Gym has, for inspect, mock and plain calls."""
    recorder = HeaderRecorder()
    client = make_client({"policy": server_entry(await http_server(recorder.app))})
    for method in (client.post, client.get, ServerClient.post, ServerClient.get):
        assert inspect.iscoroutinefunction(method)
    assert list(inspect.signature(ServerClient.post).parameters) == ["self", "server_name", "url_path", "kwargs"]
    assert ServerClient.post.__doc__ == ServerClient.get.__doc__ and "server_name" in (
        ServerClient.post.__doc__ or ""
    )
    async with await ServerClient.post(client, "policy", "/v1/responses", json={"a": 1}) as response:  # unbound
        await response.read()
    assert inspect.iscoroutinefunction(client.post) and inspect.iscoroutinefunction(client.get)  # after a call too
    overriding = PostOverridingClient(
        head_server_config=client.head_server_config, global_config_dict=client.global_config_dict
    )
    for _ in range(2):
        await call(overriding, "policy", "/v1/responses", json={"b": 2})
    assert recorder.added == [None, "post override", "post override"]
    assert recorder.bodies == [{"a": 1}, {"b": 2}, {"b": 2}]
    mocked = unittest.mock.create_autospec(ServerClient, instance=True)  # as users' tests mock the client
    await mocked.post("policy", "/v1/responses", json={})
    mocked.post.assert_awaited_once_with("policy", "/v1/responses", json={})


async def test_post_patched_on_the_class_before_a_clients_first_call_is_what_it_calls(http_server) -> None:
    """docs/nemo-gym.md: a patch of `ServerClient.post` reaches clients that have not called yet."""
    recorder = Recorder()
    client = make_client({"policy": server_entry(await http_server(recorder.app))})
    with unittest.mock.patch.object(ServerClient, "post", autospec=True) as patched:
        await client.post("policy", "/v1/responses", json={})
        await client.post("policy", "/v1/responses", json={})
    assert patched.await_count == 2 and recorder.paths == []
    await call(client, "policy", "/v1/responses")  # the patch gone, the library's own
    assert recorder.paths == ["/v1/responses"]


async def test_request_patched_on_the_class_before_a_clients_first_call_is_what_its_post_and_get_call(
    http_server,
) -> None:
    """As in NeMo Gym, `post` and `get` are `request` with the method: a patch of `ServerClient.request` reaches
    them on a client that has not called yet."""
    recorder = Recorder()
    client = make_client({"policy": server_entry(await http_server(recorder.app))})
    with unittest.mock.patch.object(ServerClient, "request", autospec=True) as patched:
        await client.post("policy", "/v1/responses", json={})
        await client.get("policy", "/health")
    assert [call.args[1:4] for call in patched.await_args_list] == [
        ("policy", "/v1/responses", "POST"),
        ("policy", "/health", "GET"),
    ]
    assert recorder.paths == []


# --- hosts -------------------------------------------------------------------------------------------------------


def ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback_available(), reason="no IPv6 loopback on this machine")
async def test_ipv6_server_reached_by_literal_and_wildcard() -> None:
    recorder = Recorder()
    runner = web.AppRunner(recorder.app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "::1", 0).start()
        port = int(runner.addresses[0][1])
        client = make_client(
            {"literal": server_entry(port, host="::1"), "wildcard": server_entry(port, host="::")}
        )
        assert client._resolve_base_url("literal") == f"http://[::1]:{port}"
        assert client._resolve_base_url("wildcard") == f"http://[::1]:{port}"
        assert await call(client, "literal", "/a") == 200
        assert await call(client, "wildcard", "/b") == 200
        assert recorder.paths == ["/a", "/b"]
    finally:
        await close_http_sessions()
        await runner.cleanup()


async def test_ipv4_wildcard_reaches_loopback(http_server) -> None:
    client = make_client({"any": server_entry(await http_server(), host="0.0.0.0")})
    assert client._resolve_base_url("any").startswith("http://127.0.0.1:")
    assert await call(client, "any", "/") == 200


# --- the reserved control pool -----------------------------------------------------------------------------------


async def test_control_call_not_delayed_by_saturated_data_pool(http_server) -> None:
    release = asyncio.Event()
    all_in_flight = asyncio.Event()
    in_flight = 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal in_flight
        in_flight += 1
        if in_flight == 4:
            all_in_flight.set()
        await asyncio.wait_for(release.wait(), 10)
        return web.Response(text="slow")

    async def fast(request: web.Request) -> web.Response:
        return web.Response(text="fast")

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_get("/fast", fast)
    port = await http_server(app)
    client = make_client({"model": server_entry(port)}, http_client={"max_connections": 4})

    async def slow_call() -> str:
        async with await client.get("model", "/slow") as response:
            return await response.text()

    slow_calls = [asyncio.create_task(slow_call()) for _ in range(4)]
    try:
        await asyncio.wait_for(all_in_flight.wait(), 5)
        with pytest.raises(TimeoutError):  # the data pool really is full
            await asyncio.wait_for(client.get("model", "/fast"), 0.3)

        # Ordering, not a stopwatch: the control call completes while all four slow calls still hold the data
        # pool (they are released only in `finally`); a shared pool would make it wait for them and time out.
        async with await asyncio.wait_for(client.request("model", "/fast", "GET", _control=True), 10) as response:
            assert await response.text() == "fast"
        assert not any(call.done() for call in slow_calls)
    finally:
        release.set()
        assert await asyncio.gather(*slow_calls) == ["slow"] * 4


# --- resend and unreachable --------------------------------------------------------------------------------------

DropServer = Callable[[int], Awaitable[tuple[int, list[int]]]]


@pytest.fixture
async def dropping_server() -> AsyncIterator[DropServer]:
    """Factory: a raw HTTP server that reads and then drops the first `drops` connections without answering, and
    answers 200 on later ones. Returns the port and a one-item list counting the connections."""
    servers: list[asyncio.Server] = []

    async def start(drops: int) -> tuple[int, list[int]]:
        server, port, connections = await start_dropping_server(drops)
        servers.append(server)
        return port, connections

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_resend_after_disconnect(dropping_server: DropServer) -> None:
    port, connections = await dropping_server(1)
    client = make_client({"model": server_entry(port)}, http_client=FAST_RETRY)
    async with await client.post("model", "/v1/responses", json={"a": 1}) as response:
        assert await response.text() == "ok"
    assert connections == [2]


async def test_no_resend_when_not_allowed(dropping_server: DropServer) -> None:
    port, connections = await dropping_server(1)
    client = make_client({"model": server_entry(port)}, http_client=FAST_RETRY)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.request("model", "/v1/responses", "POST", _resend_after_disconnect=False, json={})
    assert connections == [1]  # one connection: the request was not resent


async def test_resend_is_bounded(dropping_server: DropServer) -> None:
    port, connections = await dropping_server(1000)
    client = make_client({"model": server_entry(port)}, http_client=FAST_RETRY)
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post("model", "/v1/responses", json={})
    assert connections == [3]  # the policy's attempts, then the error


async def test_refused_server_is_unreachable_after_bounded_retries() -> None:
    port = closed_port()
    retry = {"initial_backoff_seconds": 0.01, "max_backoff_seconds": 0.05, "refused": {"seconds": 0.5}}
    client = make_client({"model": server_entry(port)}, http_client={"retry": retry})
    started = time.monotonic()
    with pytest.raises(ServerUnreachableError) as caught:
        await client.post("model", "/v1/responses", json={})
    assert time.monotonic() - started < 0.5 + 3.0  # the refused budget's 0.5 s, plus slack for a loaded machine
    assert f"http://127.0.0.1:{port}/v1/responses" in str(caught.value)
    assert caught.value.attempts > 3 and caught.value.limit == "time"  # resent for its time, not 3 attempts
    assert isinstance(caught.value, GymRpcError) and isinstance(caught.value, ConnectionError)


async def test_timeouts_are_not_retried() -> None:
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    server = await asyncio.start_server(hold, LOOPBACK, 0)
    try:
        client = make_client({"model": server_entry(int(server.sockets[0].getsockname()[1]))})
        with pytest.raises(RequestTimeoutError) as given_up:  # a TimeoutError, as aiohttp's own
            await client.post("model", "/v1/responses", timeout=aiohttp.ClientTimeout(total=0.2))
        assert given_up.value.attempts == 1
        # The server's side, on this same loop: a starved loop may time the call out before it accepts (soak run
        # B9, stop 51: 0 accepted when read at once), so it is read once the one connection is in.
        await eventually(lambda: held, within=10, every=0.01, what="the call's connection accepted")
        assert len(held) == 1
    finally:
        for writer in held:
            writer.close()
        server.close()
        await close_http_sessions()  # before wait_closed: the server waits for its connections to end
        await server.wait_closed()


# --- sessions per loop, and closing them -------------------------------------------------------------------------


def test_sessions_are_per_loop_and_close_cleanly() -> None:
    """A client outlives event loops: each loop gets its own sessions, and closing leaves nothing unclosed."""
    client = make_client({"model": server_entry(closed_port())})
    seen: list[aiohttp.ClientSession] = []

    async def use_and_close() -> None:
        sessions = client._http.sessions()
        assert sessions.data is not sessions.control
        assert client._data_plane.pools.sessions() is sessions  # what the hot path reads is the client's own
        seen.append(sessions.data)
        await client.aclose()
        assert sessions.data.closed and sessions.control.closed

    gc.collect()  # what earlier tests left behind is not this test's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(use_and_close())
        asyncio.run(use_and_close())
        seen.clear()
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    assert not any(loop.is_closed() for loop in http._sessions_by_loop)


def test_unclosed_session_would_be_caught() -> None:
    """The check above can fail: sessions left open are reported once a later loop forgets the dead loop's."""

    async def leak() -> None:
        http.loop_sessions(HttpClientSettings())  # made, never closed

    async def make_and_close() -> None:
        await http.loop_sessions(HttpClientSettings()).close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(leak())
        asyncio.run(make_and_close())
        gc.collect()
    assert any("Unclosed client session" in str(w.message) for w in caught)


async def test_one_client_in_two_loops_at_once(http_server) -> None:
    """Threads with their own loops share one client; each gets its own loop's sessions."""
    client = make_client({"model": server_entry(await http_server())})

    async def calls_then_close() -> list[int]:
        statuses = [await call(client, "model", "/") for _ in range(50)]
        await close_http_sessions()
        return statuses

    results = await asyncio.gather(*(asyncio.to_thread(asyncio.run, calls_then_close()) for _ in range(2)))
    assert results == [[200] * 50] * 2


async def test_http_client_block_sets_pool_limits(http_server) -> None:
    client = make_client(
        {"model": server_entry(await http_server())},
        http_client={"max_connections": 7, "control_max_connections": 2, "connect_timeout_seconds": 3},
    )
    assert await call(client, "model", "/") == 200
    sessions = client._http.sessions()
    assert sessions.data.connector is not None and sessions.control.connector is not None
    assert sessions.data.connector.limit == 7
    assert sessions.control.connector.limit == 2
    assert sessions.data.timeout.sock_connect == 3
    assert sessions.data.trust_env is False
    assert isinstance(sessions.data.cookie_jar, aiohttp.DummyCookieJar)


def test_bad_http_client_block_is_a_config_error() -> None:
    # ConfigError is a ValueError; pydantic wraps it in a ValidationError (also one) when raised at construction
    with pytest.raises(ValueError, match="http_client"):
        make_client({"model": server_entry(8000)}, http_client={"max_connections": 0})
    with pytest.raises(ValueError, match="http_client"):
        make_client({"model": server_entry(8000)}, http_client={"max_conections": 10})
